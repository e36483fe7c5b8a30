"""Reading batches: the one place that turns what a DataLoader yields into (x, y, domain).

Clients take the user's own DataLoaders. Their batches are tuples, ``(x, y)`` or
``(x, y, domain)`` (a ``TensorDataset``, the suite's own data), or dicts, as Hugging Face
datasets and flwr-datasets partitions give them (``{"img": ..., "label": ...}``). Every loop and
client reads batches through :func:`read_batch`, rebuilds loaders with :func:`loader_like` (so
that a user's ``collate_fn`` keeps working) and counts samples with :func:`num_samples`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from flwr_pfl.errors import ConfigError

#: flwr-datasets' image columns: "img" (CIFAR-10, CIFAR-100), "image" (MNIST, Fashion-MNIST)
DEFAULT_INPUT_KEYS = ("img", "image")
#: flwr-datasets' label columns: "label" (MNIST, Fashion-MNIST, CIFAR-10), "fine_label" (CIFAR-100)
DEFAULT_TARGET_KEYS = ("label", "fine_label")
DEFAULT_DOMAIN_KEYS = ("domain",)

Keys = str | tuple[str, ...]


def _as_keys(value: Keys | Sequence[str] | None, field: str) -> tuple[str, ...]:
    keys = (value,) if isinstance(value, str) else tuple(value or ())
    if not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"BatchKeys.{field} must be a key or a list of keys (non-empty strings); got {value!r}")
    return keys


@dataclass(frozen=True)
class BatchKeys:
    """Which entries of a dict batch hold the inputs, the targets and the domain labels.

    Each field is one key or several candidates (the first one present in the batch is used).
    The defaults read flwr-datasets' common image datasets: MNIST and Fashion-MNIST
    (``image``, ``label``), CIFAR-10 (``img``, ``label``), CIFAR-100 (``img``, ``fine_label``).
    The domain entry is optional with the default key (absent: every sample is in domain 0); a
    domain key you name must be present; ``domain=None`` never reads one.

    Example: ``BatchKeys(input="pixel_values", target="labels", domain="hospital")``.
    """

    input: Keys = DEFAULT_INPUT_KEYS
    target: Keys = DEFAULT_TARGET_KEYS
    domain: Keys | None = DEFAULT_DOMAIN_KEYS

    def __post_init__(self) -> None:
        object.__setattr__(self, "input", _as_keys(self.input, "input"))
        object.__setattr__(self, "target", _as_keys(self.target, "target"))
        if self.domain is not None:
            object.__setattr__(self, "domain", _as_keys(self.domain, "domain"))
        if not self.input or not self.target:
            raise ConfigError("BatchKeys needs at least one input key and one target key")

    def read(self, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, domain) from a dict batch; the domain is 0 where the batch holds none.

        Raises:
            ConfigError: an entry is missing (naming the keys the batch has and how to name
                them), or is not a tensor.
        """
        found = list(batch.keys())
        entries = {}
        wanted = [("input", self.input, True), ("target", self.target, True)]
        if self.domain is not None:
            wanted.append(("domain", self.domain, self.domain != DEFAULT_DOMAIN_KEYS))
        missing = []
        for role, keys, required in wanted:
            key = next((k for k in keys if k in batch), None)
            if key is not None:
                entries[role] = _tensor(batch[key], key)
            elif required:
                missing.append(f"no {role} key (looked for {', '.join(repr(k) for k in keys)})")
        if missing:
            raise ConfigError(
                f"a batch is a dict with keys {found}: {'; '.join(missing)}. Name its entries with "
                "LocalData(..., batch_keys=BatchKeys(input=..., target=..., domain=...)) "
                "(flwr_pfl.training.BatchKeys)"
            )
        x = entries["input"]
        domain = entries.get("domain", torch.zeros(len(x), dtype=torch.long))
        return x, entries["target"], domain


def _tensor(value: object, key: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ConfigError(
            f"batch[{key!r}] is a {type(value).__name__}, not a tensor; make the dataset return "
            "tensors (Hugging Face datasets: dataset.with_format('torch') or a with_transform that "
            "applies e.g. torchvision's ToTensor)"
        )
    return value


DEFAULT_KEYS = BatchKeys()


def read_batch(
    batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    device: torch.device,
    keys: BatchKeys | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, domain) of one batch, on ``device``.

    A tuple ``(x, y)`` gets domain 0 for every sample; ``(x, y, domain)`` is taken as it is; a
    dict is read with ``keys`` (default :class:`BatchKeys`, flwr-datasets' column names).

    Raises:
        ValueError: a tuple of another length; ConfigError: a dict without the named entries.
    """
    if isinstance(batch, Mapping):
        x, y, d = (keys or DEFAULT_KEYS).read(batch)
    elif isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            x, y = batch
            d = torch.zeros(len(x), dtype=torch.long)
        elif len(batch) == 3:
            x, y, d = batch
        else:
            raise ValueError(
                f"a batch must be (x, y), (x, y, domain) or a dict; got {len(batch)} elements"
            )
    else:
        raise TypeError(f"a batch must be (x, y), (x, y, domain) or a dict; got a {type(batch).__name__}")
    return x.to(device), y.to(device), d.to(device)


def loader_like(
    loader: DataLoader,
    dataset: Dataset | None = None,
    *,
    batch_size: int | None = None,
    shuffle: bool = False,
    drop_last: bool = False,
) -> DataLoader:
    """A new DataLoader over ``dataset`` (default: ``loader``'s) that collates batches as
    ``loader`` does (a user's ``collate_fn`` stays), with ``batch_size`` (default: ``loader``'s,
    or 32).

    A shuffling loader draws from torch's global generator, as the clients' loaders do. An
    unshuffled one gets a generator of its own: a DataLoader draws a seed each time it is
    iterated, and a pass that only reads the data must leave the global random state alone.
    """
    collate = {"collate_fn": loader.collate_fn} if loader.batch_sampler is not None else {}
    return DataLoader(
        loader.dataset if dataset is None else dataset,
        batch_size=batch_size or loader.batch_size or 32,
        shuffle=shuffle,
        drop_last=drop_last,
        generator=None if shuffle else torch.Generator(),
        **collate,
    )


def num_samples(loader: DataLoader) -> int:
    """Samples in ``loader``'s dataset (what a client reports as its number of examples).

    Raises:
        ConfigError: the dataset has no length (e.g. an ``IterableDataset`` or a streamed
            Hugging Face dataset).
    """
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"the loader's dataset ({type(loader.dataset).__name__}) has no length; clients report "
            "their number of examples to the server, so they need a dataset with a length "
            "(a map-style dataset: a flwr-datasets partition or a Hugging Face Dataset is one)"
        ) from None


def dataset_targets(loader: DataLoader, keys: BatchKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and domain labels of every sample of ``loader``'s dataset, in dataset order.

    Reads a ``TensorDataset``'s tensors directly; any other dataset in one pass of an unshuffled
    :func:`loader_like` (no random draws).
    """
    dataset = loader.dataset
    if isinstance(dataset, TensorDataset):
        tensors = dataset.tensors
        y = tensors[1]
        return y, tensors[2] if len(tensors) > 2 else torch.zeros(len(y), dtype=torch.long)
    ys, ds = [], []
    for batch in loader_like(loader):
        _, y, d = read_batch(batch, torch.device("cpu"), keys)
        ys.append(y)
        ds.append(d)
    if not ys:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(ys), torch.cat(ds)
