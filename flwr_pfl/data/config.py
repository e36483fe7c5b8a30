"""The data layer's configuration: one frozen, validated dataclass.

Flower's run-config keys are kebab-case (``dirichlet-alpha``); the fields are snake_case
(``dirichlet_alpha``). :meth:`DataConfig.from_run_config` maps the keys it knows, so the app
parses them once, at the boundary. Every check raises :class:`~flwr_pfl.errors.ConfigError`
naming the key, the value received and what is allowed. The dataclass is hashable, so the
pipeline can cache its stages per config.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr_pfl.data.registry import available_datasets, noise_free_datasets
from flwr_pfl.errors import ConfigError

PARTITIONERS = (
    "iid", "dirichlet", "pathological", "domain-mixture", "one-domain-per-client", "domain-dirichlet",
    "label-shift",
)
DOMAIN_TRANSFORMS = ("none", "rotation", "color", "corruption")
DOMAIN_CLIENT_PARTITIONERS = ("one-domain-per-client", "domain-dirichlet")


@dataclass(frozen=True)
class DataConfig:
    """Which dataset, how it is split into domains and clients, and each client's local split.

    Attributes (run-config key in brackets):
        dataset [dataset]: a registered dataset name; built in: mnist, fashion-mnist, cifar10,
            cifar100 (see ``flwr_pfl.data.registry.register_dataset`` to add more).
        data_dir [data-dir]: root folder of the datasets, in torchvision's layout
            (``<data-dir>/MNIST/raw/...``). ``~`` is expanded; the result must be absolute,
            because Flower runs apps from their own install folder.
        download [download]: let torchvision download a missing dataset (needs internet).
        partitioner [partitioner]: how samples are dealt to clients: iid, dirichlet (label
            skew), pathological (k classes per client), domain-mixture (Dirichlet domain mix,
            fixed size), one-domain-per-client (client k holds domain k mod M, or as
            ``domain_clients`` says, split IID among that domain's clients), domain-dirichlet
            (the same, split with Dirichlet ``dirichlet_alpha`` label skew among that domain's
            clients), label-shift (the last client gets 1 - eta of the ``shifted-classes``
            and eta of the others, the other clients split the rest equally: FedGP's App. C.7
            label shift).
        label_shift_eta [label-shift-eta]: eta of label-shift, in [0, 0.5] (0.5 = no shift).
        shifted_classes [shifted-classes]: label-shift's D1 classes, comma-separated
            (default "8,6,9", the paper's code for Fashion-MNIST).
        dirichlet_alpha [dirichlet-alpha]: concentration of the label-skew Dirichlet, > 0.
        classes_per_client [classes-per-client]: labels per client for pathological, >= 1.
        domain_transform [domain-transform]: none, rotation, color or corruption; turns one
            dataset into ``num_domains`` domains (``flwr_pfl.data.domains``).
        num_domains [num-domains]: number of domains made by the transform (1 for none; a
            dataset with natural domains brings its own count).
        domain_clients [domain-clients]: for one-domain-per-client and domain-dirichlet, how
            many clients each domain gets, comma-separated, one positive count per domain,
            summing to the number of clients: "9,1" gives domain 0 clients 0-8 and domain 1
            client 9 (FedGP's nine clean sources and one noisy target). With a domain
            transform the domains' shares of the samples follow the counts too, so that every
            client gets about as much data (a dataset's own domains keep their sizes). ""
            (default): client k holds domain k mod M, and the transform makes equal domains.
        rotation_step [rotation-step]: degrees between consecutive rotation domains, > 0.
        clean_domain [clean-domain]: for corruption, make domain 0 the unchanged images.
        noise_std [noise-std]: for corruption, the std of the additive gaussian noise, in
            [0, 1] pixel units (before standardisation), >= 0 (default 0.3).
        noise_clip [noise-clip]: for corruption, clip noisy pixels to [0, 1] (default true;
            false: FedGP App. C.7's unclipped noise).
        domain_alpha [domain-alpha]: concentration of the domain-mixture partitioner, > 0.
        samples_per_client [samples-per-client]: exact client size for domain-mixture
            (required > 0 there); for the other partitioners a positive value caps each
            client's size, and 0 keeps what the partitioner gives.
        large_client [large-client]: the imbalanced layout of FEDORA's App. B: this client
            takes every sample of the pool the others do not. Each other client holds
            exactly ``samples_per_client`` samples (required > 0); the large client's domain
            gets the rest of the pool (``max_samples``, or all of it), its test split is as
            large as the others' and the rest is cut into validation and training in the
            others' ratio. For one-domain-per-client with a domain transform and one client per
            domain (``domain_clients`` empty, as many clients as domains). FEDORA's Rotated
            MNIST: K = 36, samples-per-client = 469 (128 + 64 + 277), max-samples = 69972
            gives client 17 35 516 training and 17 764 validation samples (the paper: 35 520
            and 17 760). -1 (default): every client alike.
        max_samples [max-samples]: 0 keeps the whole pool; otherwise a seeded subsample,
            stratified by label, of this many samples (short CPU runs).
        val_fraction [val-fraction], test_fraction [test-fraction]: shares of each client's
            samples held out for validation and test, each in [0, 1), sum < 1.
        train_fraction [train-fraction]: share of each client's training split kept, in (0, 1]
            (a uniform subsample, at least one sample; validation and test splits unchanged):
            pFedFDA's data-scarcity protocol (Table 1's 75 / 50 / 25 % columns, the official
            code's ``--train_prop``). Default 1 keeps all.
        noise_free_test [noise-free-test]: evaluate on noise-free targets: every client's test
            split gets its samples' targets without the noise the training and validation
            targets carry (FedDAR Fig. 1's noise-free test set, so the test error has no
            sigma^2 floor). Only for datasets that provide them (``feddar-synthetic``); default
            false (the test targets carry the noise too).
        seed [seed]: seeds every random choice of the data layer.
    """

    dataset: str = "mnist"
    data_dir: str = "~/.cache/flwr_pfl/data"
    download: bool = False
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    label_shift_eta: float = 0.1
    shifted_classes: str = "8,6,9"
    classes_per_client: int = 2
    domain_transform: str = "none"
    num_domains: int = 1
    domain_clients: str = ""
    rotation_step: float = 15.0
    clean_domain: bool = False
    noise_std: float = 0.3  # domains.NOISE_STD (not imported: it would load torch here)
    noise_clip: bool = True
    domain_alpha: float = 1.0
    samples_per_client: int = 0
    large_client: int = -1
    max_samples: int = 0
    val_fraction: float = 0.0
    test_fraction: float = 0.2
    train_fraction: float = 1.0
    noise_free_test: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _check_type(self, "dataset", str)
        _check_choice(self, "dataset", available_datasets())
        _check_type(self, "data_dir", str)
        expanded = os.path.expanduser(self.data_dir)
        if not os.path.isabs(expanded):
            _fail("data_dir", self.data_dir, "an absolute path (after expanding '~')")
        object.__setattr__(self, "data_dir", expanded)
        _check_type(self, "download", bool)
        _check_type(self, "partitioner", str)
        _check_choice(self, "partitioner", PARTITIONERS)
        _check_number(self, "dirichlet_alpha", low=0.0, low_open=True)
        _check_number(self, "label_shift_eta", low=0.0)
        if self.label_shift_eta > 0.5:
            _fail("label_shift_eta", self.label_shift_eta, "a number in [0, 0.5] (0.5 = no shift)")
        _check_type(self, "shifted_classes", str)
        try:
            ids = self.shifted_class_ids()
        except ValueError:
            ids = ()
        if not ids or min(ids) < 0:
            _fail("shifted_classes", self.shifted_classes, "comma-separated class ids >= 0, e.g. '8,6,9'")
        _check_int(self, "classes_per_client", low=1)
        _check_type(self, "domain_transform", str)
        _check_choice(self, "domain_transform", DOMAIN_TRANSFORMS)
        _check_int(self, "num_domains", low=1)
        if self.domain_transform == "none" and self.num_domains != 1:
            _fail(
                "num_domains",
                self.num_domains,
                "1 when domain-transform is 'none' (set domain-transform to rotation, color "
                "or corruption to make several domains)",
            )
        self._check_domain_clients()
        _check_number(self, "rotation_step", low=0.0, low_open=True)
        _check_type(self, "clean_domain", bool)
        _check_number(self, "noise_std", low=0.0)
        _check_type(self, "noise_clip", bool)
        if self.domain_transform == "corruption":
            from flwr_pfl.data.domains import Corruption  # torchvision only when needed

            Corruption.first(self.num_domains, self.clean_domain)  # checks the domain count
        _check_number(self, "domain_alpha", low=0.0, low_open=True)
        _check_int(self, "samples_per_client", low=0)
        if self.partitioner == "domain-mixture" and self.samples_per_client == 0:
            _fail(
                "samples_per_client",
                0,
                "> 0 with partitioner 'domain-mixture' (every client draws exactly this many)",
            )
        self._check_large_client()
        _check_int(self, "max_samples", low=0)
        _check_number(self, "val_fraction", low=0.0, high=1.0)
        _check_number(self, "test_fraction", low=0.0, high=1.0)
        if self.val_fraction + self.test_fraction >= 1.0:
            _fail(
                "test_fraction",
                self.test_fraction,
                f"a value with val-fraction + test-fraction < 1 (val-fraction is "
                f"{self.val_fraction}), so that clients keep training samples",
            )
        _check_number(self, "train_fraction", low=-math.inf)  # a finite number, stored as float
        if not 0.0 < self.train_fraction <= 1.0:
            _fail("train_fraction", self.train_fraction, "a number in (0, 1] (1 keeps every training sample)")
        self._check_noise_free_test()
        _check_int(self, "seed")

    def _check_noise_free_test(self) -> None:
        """``noise_free_test``: a bool, true only for a dataset that has noise-free targets."""
        _check_type(self, "noise_free_test", bool)
        supported = noise_free_datasets()
        if self.noise_free_test and self.dataset not in supported:
            names = ", ".join(repr(n) for n in supported) or "none is registered"
            _fail(
                "noise_free_test",
                self.noise_free_test,
                f"false for dataset {self.dataset!r}, which has no noise-free targets "
                f"(datasets that have them: {names})",
            )

    def _check_large_client(self) -> None:
        """``large_client``: -1, or a client index of the one-domain-per-client layout whose
        other clients have a fixed size."""
        _check_int(self, "large_client", low=-1)
        if self.large_client < 0:
            return
        needs = (
            (
                self.partitioner == "one-domain-per-client",
                f"partitioner 'one-domain-per-client' (got {self.partitioner!r})",
            ),
            (
                self.domain_transform != "none",
                "a domain transform (rotation, color or corruption), whose domain sizes the "
                "layout sets",
            ),
            (
                not self.domain_clients.strip(),
                f"domain-clients '' (one client per domain; got {self.domain_clients!r})",
            ),
            (
                self.samples_per_client > 0,
                "samples-per-client > 0 (the size of every other client)",
            ),
            (
                self.large_client < self.num_domains,
                f"a client index below num-domains = {self.num_domains} (one client per "
                f"domain)",
            ),
        )
        for ok, allowed in needs:
            if not ok:
                _fail("large_client", self.large_client, f"-1 (no large client), or with {allowed}")

    def _check_domain_clients(self) -> None:
        """``domain_clients``: its type, its partitioner, its format and (with a domain
        transform, which fixes the domain count) one count per domain."""
        _check_type(self, "domain_clients", str)
        if not self.domain_clients.strip():
            return
        if self.partitioner not in DOMAIN_CLIENT_PARTITIONERS:
            _fail(
                "domain_clients",
                self.domain_clients,
                f"'' with partitioner {self.partitioner!r} (it sets the clients of each domain "
                f"for {' and '.join(repr(p) for p in DOMAIN_CLIENT_PARTITIONERS)})",
            )
        known = self.num_domains if self.domain_transform != "none" else None
        self.domain_client_counts(num_domains=known)

    def domain_client_counts(
        self, num_domains: int | None = None, num_clients: int | None = None
    ) -> tuple[int, ...] | None:
        """``domain_clients`` as integers, or None for the default layout (client k holds
        domain k mod M).

        Raises:
            ConfigError: the counts are not positive integers, or (when given) there is not one
                per domain or they do not sum to the number of clients.
        """
        text = self.domain_clients
        if not text.strip():
            return None
        try:
            counts = tuple(int(c) for c in text.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            _fail(
                "domain_clients",
                text,
                "comma-separated client counts >= 1, one per domain (e.g. '9,1'), or '' for "
                "client k holding domain k mod M",
            )
        if num_domains is not None and len(counts) != num_domains:
            _fail(
                "domain_clients",
                text,
                f"one client count per domain: {num_domains} counts for the {num_domains} "
                f"domains (num-domains or the dataset's own)",
            )
        if num_clients is not None and sum(counts) != num_clients:
            _fail(
                "domain_clients",
                text,
                f"client counts summing to the number of clients, {num_clients} (they sum to "
                f"{sum(counts)})",
            )
        return counts

    def shifted_class_ids(self) -> tuple[int, ...]:
        """``shifted_classes`` as integers."""
        return tuple(int(c) for c in self.shifted_classes.split(",") if c.strip())

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> DataConfig:
        """A config from Flower run-config keys; keys the data layer does not use are ignored."""
        known = {run_key(f.name): f.name for f in dataclasses.fields(cls)}
        return cls(**{known[k]: v for k, v in run_config.items() if k in known})

    def to_run_config(self) -> dict[str, Any]:
        """The config as run-config keys and values (for results files)."""
        return {run_key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def run_key(field: str) -> str:
    """The run-config key of a field: ``dirichlet_alpha`` -> ``dirichlet-alpha``."""
    return field.replace("_", "-")


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(
        f"data config key {run_key(field)!r} (DataConfig.{field}) must be {allowed}; "
        f"got {value!r}"
    )


def _check_type(config: DataConfig, field: str, kind: type) -> None:
    value = getattr(config, field)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        _fail(field, value, f"of type {kind.__name__}")


def _check_choice(config: DataConfig, field: str, allowed: tuple[str, ...]) -> None:
    value = getattr(config, field)
    if value not in allowed:
        _fail(field, value, "one of " + ", ".join(repr(a) for a in allowed))


def _check_int(config: DataConfig, field: str, low: int | None = None) -> None:
    _check_type(config, field, int)
    value = getattr(config, field)
    if low is not None and value < low:
        _fail(field, value, f"an integer >= {low}")


def _check_number(
    config: DataConfig,
    field: str,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    """Accept int or float (TOML writes ``1`` for 1.0), store a float, check the range.

    The range is [low, high) or, with ``low_open``, (low, inf).
    """
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(field, value, "a number")
    value = float(value)
    inside = value > low if low_open else value >= low
    if high is not None:
        inside = inside and value < high
    if not inside or not math.isfinite(value):
        where = f"> {low}" if low_open else f"in [{low}, {high})" if high is not None else f">= {low}"
        _fail(field, getattr(config, field), f"a number {where}")
    object.__setattr__(config, field, value)
