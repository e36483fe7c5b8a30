"""What the ClientApp builds for its nodes, built once per process and reused across messages.

Flower's engines call the ClientApp once per message, and one process (a Ray actor, the
in-process grid) serves many nodes, one message at a time. Building everything afresh for every
message re-parsed the run config (about 175 keys), re-assembled the node's tensors and
initialised a new model each time: at 1,000 clients that was most of a round. A
:class:`ClientCache` keeps, for the run its process is serving:

* the parsed :class:`~flwr_pfl.app.config.Experiment`;
* each partition's :class:`~flwr_pfl.data.types.ClientData` (read-only tensors), up to
  :data:`DATA_BUDGET_BYTES`, least recently used first out;
* a pool of models per architecture: a message leases one, reset to the state of a fresh
  build (:func:`reset_model`), and gives it back when the message is done.

A run is known by its run id *and* its run config (the in-process engine numbers every run 1),
so a message of another run, or of the same run id with other settings, drops everything kept
for the previous one. Nothing a message leaves behind reaches the next: personal state lives in
``context.state`` as before, the data is never written to, and a leased model is reset to the
values, flags and modes it had when built.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from flwr_pfl.app.config import Experiment, parse_experiment
from flwr_pfl.data.types import ClientData

#: tensor bytes of client data one process keeps per run (beyond it, least recently used first out)
DATA_BUDGET_BYTES = 1 << 30


def _signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of every parameter and buffer: what a reset cannot restore."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors]


def reset_model(model: nn.Module, template: nn.Module) -> None:
    """Make ``model`` (a deep copy of ``template`` that a message has used) equal to ``template``.

    Restores every parameter and buffer value (in place, on whatever device ``model`` is on), the
    ``requires_grad`` flags and train/eval modes, and drops gradients: after this, ``model``
    computes exactly what a fresh copy of ``template`` would.
    """
    source = dict(template.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(source[name])
            p.grad = None
            p.requires_grad_(source[name].requires_grad)
        buffers = dict(template.named_buffers())
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    for module, original in zip(model.modules(), template.modules()):
        module.training = original.training


class ModelPool:
    """Models of one architecture for one run: a pristine template and its leased copies."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        self.template = build()
        self._signature = _signature(self.template)
        self._free: list[nn.Module] = []
        self._lock = threading.Lock()

    def take(self) -> nn.Module:
        """A model equal to a fresh build: a returned one reset, or a new copy of the template."""
        with self._lock:
            model = self._free.pop() if self._free else None
        if model is None:
            return copy.deepcopy(self.template)
        reset_model(model, self.template)
        return model

    def give_back(self, model: nn.Module) -> None:
        """Return a leased model; one whose tensors changed shape or dtype is dropped instead."""
        if _signature(model) == self._signature:
            with self._lock:
                self._free.append(model)


class RunCache:
    """What one run's messages share in this process: parsed config, clients' data, model pools."""

    def __init__(self, run_id: int, run_config: Mapping[str, Any]) -> None:
        self.run_id = run_id
        self.run_config = dict(run_config)
        self.experiment: Experiment = parse_experiment(self.run_config)
        self._data: OrderedDict[tuple[int, int], tuple[ClientData, int]] = OrderedDict()
        self._data_bytes = 0
        self._pools: dict[Hashable, ModelPool] = {}
        self._lock = threading.Lock()

    def serves(self, run_id: int, run_config: Mapping[str, Any]) -> bool:
        return run_id == self.run_id and run_config == self.run_config

    def client_data(self, partition_id: int, num_partitions: int, load: Callable[[], ClientData]) -> ClientData:
        """The partition's data, loaded on first use."""
        key = (partition_id, num_partitions)
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key][0]
        data = load()
        size = sum(t.nbytes for split in (data.train, data.val, data.test) for t in (split.x, split.y, split.domain))
        with self._lock:
            if key not in self._data:
                self._data[key] = (data, size)
                self._data_bytes += size
                while self._data_bytes > DATA_BUDGET_BYTES and len(self._data) > 1:
                    _, (_, dropped) = self._data.popitem(last=False)
                    self._data_bytes -= dropped
        return data

    def pool(self, key: Hashable, build: Callable[[], nn.Module]) -> ModelPool:
        with self._lock:
            if key not in self._pools:
                self._pools[key] = ModelPool(build)
            return self._pools[key]


class ClientCache:
    """The process's :class:`RunCache` for the run it serves, and the models leased per message.

    Models are leased only inside :meth:`message` (the ClientApp wraps every message in it);
    outside one, :meth:`model` builds a fresh model that nobody else holds.
    """

    def __init__(self) -> None:
        self._run: RunCache | None = None
        self._lock = threading.Lock()
        self._local = threading.local()

    def run(self, run_id: int, run_config: Mapping[str, Any]) -> RunCache:
        """The cache of this run; a new one (dropping the old) when the run id or config differs."""
        with self._lock:
            if self._run is None or not self._run.serves(run_id, run_config):
                self._run = None  # free the previous run's data and models before building anew
                self._run = RunCache(run_id, run_config)
            return self._run

    def clear(self) -> None:
        """Forget everything kept (the next message rebuilds)."""
        with self._lock:
            self._run = None

    @contextmanager
    def message(self) -> Iterator[None]:
        """The scope of one message: models leased inside go back to their pools at its end."""
        leases: list[tuple[ModelPool, nn.Module]] = []
        outer = getattr(self._local, "leases", None)
        self._local.leases = leases
        try:
            yield
        finally:
            self._local.leases = outer
            for pool, model in leases:
                pool.give_back(model)

    def model(self, run: RunCache, key: Hashable, build: Callable[[], nn.Module]) -> nn.Module:
        """A model equal to ``build()``: leased from ``run``'s pool inside a message, else fresh."""
        leases = getattr(self._local, "leases", None)
        if leases is None:
            return build()
        pool = run.pool(key, build)
        model = pool.take()
        leases.append((pool, model))
        return model
