"""Shared test scaffolding: fake Flower clients and replies, pFedFDA's server-side wire and
strategy, a tiny seeded model, a synthetic covariate-shift dataset, a kill of a running app.

Plain helpers, imported as ``from fakes import ...``: ``tests/`` is on ``sys.path`` through
``pythonpath`` in pyproject.toml."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from flwr.common import (
    Code,
    EvaluateRes,
    FitRes,
    GetParametersRes,
    GetPropertiesRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from torch import nn

import flwr_pfl.core.pfedfda as pfedfda
from flwr_pfl.app.results import ResultsWriter
from flwr_pfl.data.registry import DatasetPool, register_dataset
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.strategies import PFedFDA
from flwr_pfl.training import get_arrays

TESTS_DIR = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------ clients
class FakeProxy(ClientProxy):
    """A client proxy with a cid and, optionally, a partition id.

    ``get_properties`` answers ``{"partition_id": pid}`` (the strategies' partition query);
    everything else raises ``NotImplementedError``: a test that needs a fit or an evaluation
    subclasses and overrides that method only.
    """

    def __init__(self, cid: str, pid: int | None = None) -> None:
        super().__init__(cid)
        self.pid = pid

    def get_properties(self, ins, timeout, group_id):
        if self.pid is None:  # pragma: no cover
            raise NotImplementedError
        return GetPropertiesRes(Status(Code.OK, ""), {"partition_id": self.pid})

    def get_parameters(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):  # pragma: no cover
        raise NotImplementedError


class NumPyProxy(FakeProxy):
    """A proxy around a real NumPyClient, as Flower's engines are: ``fit`` / ``evaluate`` /
    ``get_parameters`` call the client with the instruction's arrays and config; every config
    received is recorded in ``fit_configs`` / ``evaluate_configs``."""

    def __init__(self, cid: str, pid: int, client) -> None:
        super().__init__(cid, pid)
        self.client = client
        self.fit_configs: list[dict] = []
        self.evaluate_configs: list[dict] = []

    def get_parameters(self, ins, timeout, group_id):
        return GetParametersRes(Status(Code.OK, ""), ndarrays_to_parameters(self.client.get_parameters(dict(ins.config))))

    def fit(self, ins, timeout, group_id):
        self.fit_configs.append(dict(ins.config))
        arrays, n, metrics = self.client.fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)

    def evaluate(self, ins, timeout, group_id):
        self.evaluate_configs.append(dict(ins.config))
        loss, n, metrics = self.client.evaluate(parameters_to_ndarrays(ins.parameters), dict(ins.config))
        return EvaluateRes(Status(Code.OK, ""), loss, n, metrics)


def client_manager(proxies: Iterable[ClientProxy]) -> SimpleClientManager:
    """A ``SimpleClientManager`` with every proxy of ``proxies`` registered."""
    cm = SimpleClientManager()
    for proxy in proxies:
        cm.register(proxy)
    return cm


def manager(n: int, first_cid: int = 5000, cid_step: int = 7) -> SimpleClientManager:
    """``n`` FakeProxy clients, partition ids 0 .. n - 1, cids ``first_cid + cid_step * pid``."""
    return client_manager(FakeProxy(str(first_cid + cid_step * i), i) for i in range(n))


# ------------------------------------------------------------------------------ replies
def fit_res(arrays: list[np.ndarray], n: int = 10, pid: int = 0, metrics: dict | None = None) -> FitRes:
    """An OK FitRes: ``arrays`` on the wire, ``n`` examples, metrics ``{"partition_id": pid}``
    updated with ``metrics`` (a ``partition_id`` there wins)."""
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, {"partition_id": pid} | (metrics or {}))


# ------------------------------------------------------------------------------ pFedFDA server
PFEDFDA_CLASSES, PFEDFDA_FEATURES = 3, 4


def pfedfda_wire(backbone_value: float = 0.0, mu=None, cov=None) -> list[np.ndarray]:
    """pFedFDA's wire layout for a Linear(2, 4) backbone filled with ``backbone_value``, 3 class
    means (zeros unless ``mu``) and the shared covariance (identity unless ``cov``)."""
    c, d = PFEDFDA_CLASSES, PFEDFDA_FEATURES
    backbone = [np.full((d, 2), backbone_value, np.float32), np.full((d,), backbone_value, np.float32)]
    mu = np.zeros((c, d), np.float32) if mu is None else mu
    cov = np.eye(d, dtype=np.float32) if cov is None else cov
    return pfedfda.join_wire(backbone, mu, cov)


def pfedfda_strategy(**kwargs) -> PFedFDA:
    """A PFedFDA strategy over 10 clients (fraction 0.3, seed 0, a 1000-round run: no test
    reaches its full last round unless it sets ``num_rounds``); ``kwargs`` override."""
    return PFedFDA(**({"num_clients": 10, "fraction_fit": 0.3, "seed": 0, "wait_timeout": 5, "num_rounds": 1000} | kwargs))


def ready_pfedfda_strategy(**kwargs) -> PFedFDA:
    """``pfedfda_strategy(**kwargs)`` after its first ``configure_fit`` (it knows every client)."""
    s = pfedfda_strategy(**kwargs)
    s.configure_fit(1, ndarrays_to_parameters(pfedfda_wire()), manager(10))
    return s


# ------------------------------------------------------------------------------ models
def tiny_model(seed: int = 0, scale: float = 1.0) -> EncoderHeadModel:
    """A Linear(5, 4) + tanh body and a 3-output head, every parameter ``scale`` x N(0, 1) from
    a generator seeded with ``seed`` (no buffers: every tensor is a parameter)."""
    g = torch.Generator().manual_seed(seed)
    model = EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def arrays_of(seed: int, scale: float = 1.0) -> list[np.ndarray]:
    """The arrays of ``tiny_model(seed, scale)``."""
    return get_arrays(tiny_model(seed, scale))


def assert_arrays_close(actual, expected, atol: float = 1e-6) -> None:
    """Same number of arrays, each close to its counterpart (rtol 1e-5, compared in float64)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=1e-5, atol=atol)


# ------------------------------------------------------------------------------ a user's own model and data
class QuickNet(nn.Module):
    """Flower quickstart-pytorch's ``Net`` shrunk for tests: conv1, pool, conv2, fc1, fc2, fc3 on
    (3, 16, 16) images; ``fc3`` maps fc2's 12 features to the classes."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.fc1 = nn.Linear(6 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 12)
        self.fc3 = nn.Linear(12, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def image_tensors(n: int, seed: int, num_classes: int = 3, num_domains: int = 2) -> tuple[torch.Tensor, ...]:
    """``n`` random (3, 16, 16) images whose class shifts their mean, labels cycling through the
    classes, domain labels cycling through the domains (x float32, y and domain int64)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    d = (torch.arange(n) // num_classes) % num_domains
    x = torch.randn(n, 3, 16, 16, generator=g) + 0.5 * y.float().reshape(-1, 1, 1, 1)
    return x, y, d


class DictImages(torch.utils.data.Dataset):
    """A map-style dataset of dicts, as Hugging Face / flwr-datasets give them: sample i is
    ``{input_key: x[i], target_key: y[i]}`` plus ``{domain_key: d[i]}`` when a domain key is given."""

    def __init__(self, x, y, d=None, input_key: str = "img", target_key: str = "label", domain_key: str | None = None) -> None:
        self.x, self.y, self.d = x, y, d
        self.keys = (input_key, target_key, domain_key)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        input_key, target_key, domain_key = self.keys
        item = {input_key: self.x[i], target_key: self.y[i]}
        if domain_key is not None:
            item[domain_key] = self.d[i]
        return item


# ------------------------------------------------------------------------------ data
def register_shift_dataset(name: str, sources_relabelled: bool = False) -> str:
    """Register ``name``: 4 Gaussian classes in 20 dimensions x 4 domains, 500 samples per
    domain; domain m's class centres are the shared centres (1.2 x N(0, 1)) plus a fixed offset
    (0.8 x N(0, 1); a covariate shift), with noise of std 2. With ``sources_relabelled`` the
    sources (domains 0-2) label class c as (c + 1) mod 4; domain 3 keeps the true labels."""

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(4321)
        centers = 1.2 * torch.randn(4, 20, generator=g)
        offsets = 0.8 * torch.randn(4, 20, generator=g)
        per = 500
        c = torch.arange(4 * per) % 4
        d = torch.arange(4 * per) // per
        x = centers[c] + offsets[d] + 2.0 * torch.randn(4 * per, 20, generator=g)
        y = torch.where(d < 3, (c + 1) % 4, c) if sources_relabelled else c
        return DatasetPool(x=x, y=y, domain=d, num_classes=4, num_domains=4)

    register_dataset(name, build, replace=True)
    return name


def register_domain_blobs(name: str, seed: int, center_scale: float) -> str:
    """Register ``name``: 4 classes x 3 domains (a covariate shift per domain), 1,440 samples
    in 12 dimensions; class centres ``center_scale`` x N(0, 1), domain offsets 0.8 x N(0, 1),
    unit noise, all drawn from ``seed``."""

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(seed)
        centers = center_scale * torch.randn(4, 12, generator=g)
        offsets = 0.8 * torch.randn(3, 12, generator=g)
        n = 1440
        y = torch.arange(n) % 4
        d = (torch.arange(n) // 4) % 3
        x = centers[y] + offsets[d] + torch.randn(n, 12, generator=g)
        return DatasetPool(x=x, y=y, domain=d, num_classes=4, num_domains=3)

    register_dataset(name, build, replace=True)
    return name


# ------------------------------------------------------------------------------ modules
def load_test_module(relative_path: str, name: str) -> ModuleType:
    """Import the test file ``tests/<relative_path>`` as module ``name`` (for its helpers)."""
    spec = importlib.util.spec_from_file_location(name, TESTS_DIR / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Killed(BaseException):
    """Stands for the process being killed (not an Exception: nothing may catch it)."""


def kill_at(monkeypatch, server_round: int, where: str) -> None:
    """Stop the next app run at ``server_round``: ``"end"`` (after its checkpoint, if one is due)
    or a phase (``"fit"``, ``"evaluate"``: right after that phase's row was appended), by raising
    :class:`Killed` from the results writer."""
    end_round, on_round = ResultsWriter.end_round, ResultsWriter.on_round

    def end(self, r):
        end_round(self, r)
        if where == "end" and r == server_round:
            raise Killed(f"killed after round {r}")

    def row(self, r, phase, metrics, clients):
        on_round(self, r, phase, metrics, clients)
        if phase == where and r == server_round:
            raise Killed(f"killed after the {phase} row of round {r}")

    monkeypatch.setattr(ResultsWriter, "end_round", end)
    monkeypatch.setattr(ResultsWriter, "on_round", row)


# ------------------------------------------------------------------------------ models with modes
class BatchNormDropoutNet(nn.Module):
    """A user's MLP with train/eval behaviour: fc1 (6 -> 8), BatchNorm1d (running statistics and
    the integer ``num_batches_tracked``), ReLU, Dropout(0.5), then the head ``fc2`` (8 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class MiddleHeadNet(nn.Module):
    """The same network as :class:`BatchNormDropoutNet` with its head registered second of four,
    inside a ModuleDict: ``layers`` = embed (6 -> 8), head (8 -> 3), norm (BatchNorm1d), drop;
    forward runs embed, norm, ReLU, drop, head. Built after the same ``torch.manual_seed``, it
    has the same weights (the Linear layers draw in the same order) in another state_dict order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {"embed": nn.Linear(6, 8), "head": nn.Linear(8, 3), "norm": nn.BatchNorm1d(8), "drop": nn.Dropout(0.5)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = self.layers
        return layers["head"](layers["drop"](torch.relu(layers["norm"](layers["embed"](x)))))


def split_loaders(x: torch.Tensor, y: torch.Tensor, d: torch.Tensor, train: int, held_out: int, num_domains: int = 2):
    """A LocalData of ``train`` training samples, then ``held_out`` validation and ``held_out``
    test samples of ``(x, y, d)``: shuffled training batches of 8, evaluation batches of 16."""
    from torch.utils.data import DataLoader, TensorDataset

    from flwr_pfl.clients import LocalData

    parts = slice(0, train), slice(train, train + held_out), slice(train + held_out, train + 2 * held_out)
    loaders = [DataLoader(TensorDataset(x[s], y[s], d[s]), batch_size=8 if i == 0 else 16, shuffle=i == 0)
               for i, s in enumerate(parts)]
    return LocalData(train=loaders[0], val=loaders[1], test=loaders[2], num_domains=num_domains)


def handed_out_seconds(monkeypatch) -> list[float]:
    """Make each call of the shared train loop through :meth:`PFLClient.train_groups` report a
    time of its own (1, 2, 4, ... seconds) and return the list of the times handed out, so that a
    test can check a client's ``train_seconds`` is the sum over its training phases (powers of
    two: a dropped or subtracted phase gives another number)."""
    import dataclasses

    from flwr_pfl.clients import base

    real = base.train
    handed: list[float] = []

    def timed(*args, **kwargs):
        stats = real(*args, **kwargs)
        handed.append(float(2 ** len(handed)))
        return dataclasses.replace(stats, seconds=handed[-1])

    monkeypatch.setattr(base, "train", timed)
    return handed
