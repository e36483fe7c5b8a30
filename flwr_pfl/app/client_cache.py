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


def _layout(module: nn.Module) -> tuple[Any, ...]:
    """The objects one module holds directly: its parameters, buffers and submodules."""
    return (*module._parameters.values(), None, *module._buffers.values(), None, *module._modules.values())


class _Copy:
    """A leased copy of the template, paired tensor by tensor and module by module with it, so
    that checking and resetting it never walks the module tree again."""

    def __init__(self, model: nn.Module, template: nn.Module) -> None:
        self.model = model
        self.modules = list(zip(model.modules(), template.modules()))
        self.layouts = [_layout(m) for m, _ in self.modules]
        self.parameters = list(zip(model.parameters(), template.parameters()))
        self.buffers = list(zip(model.buffers(), template.buffers()))
        self.kinds = [(t.shape, t.dtype) for t, _ in self.parameters + self.buffers]

    def intact(self) -> bool:
        """Whether the model still holds the same parameter, buffer and module objects, with
        their shapes and dtypes (a message that swapped a layer or cast the model fails this)."""
        same = all(
            len(now := _layout(m)) == len(then) and all(a is b for a, b in zip(now, then))
            for (m, _), then in zip(self.modules, self.layouts)
        )
        return same and all((t.shape, t.dtype) == kind for (t, _), kind in zip(self.parameters + self.buffers, self.kinds))

    def reset(self) -> None:
        """Every value, ``requires_grad`` flag and train/eval mode back to the template's; no
        gradients (in place, on whatever device the model is on)."""
        with torch.no_grad():
            for t, source in self.parameters + self.buffers:
                t.copy_(source)
        for p, source in self.parameters:
            p.grad = None
            p.requires_grad_(source.requires_grad)
        for module, source in self.modules:
            module.training = source.training


def reset_model(model: nn.Module, template: nn.Module) -> None:
    """Make ``model`` (a deep copy of ``template`` that a message has used) equal to ``template``:
    every parameter and buffer value, the ``requires_grad`` flags and train/eval modes, and no
    gradients; it then computes exactly what a fresh copy of ``template`` would."""
    _Copy(model, template).reset()


class ModelPool:
    """Models of one architecture for one run: a pristine template and its leased copies."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        self.template = build()
        self._free: list[_Copy] = []
        self._leased: dict[int, _Copy] = {}
        self._lock = threading.Lock()

    def take(self) -> nn.Module:
        """A model equal to a fresh build: a returned one reset, or a new copy of the template."""
        with self._lock:
            copy_ = self._free.pop() if self._free else None
        if copy_ is None:
            copy_ = _Copy(copy.deepcopy(self.template), self.template)
        else:
            copy_.reset()
        with self._lock:
            self._leased[id(copy_.model)] = copy_
        return copy_.model

    def give_back(self, model: nn.Module) -> None:
        """Return a leased model; one whose structure, shapes or dtypes changed is dropped."""
        with self._lock:
            copy_ = self._leased.pop(id(model), None)
        if copy_ is not None and copy_.intact():
            with self._lock:
                self._free.append(copy_)


class RunCache:
    """What one run's messages share in this process: parsed config, clients' data, model pools."""

    def __init__(self, run_id: int, run_config: Mapping[str, Any]) -> None:
        self.run_id = run_id
        self.run_config = dict(run_config)
        self.experiment: Experiment = parse_experiment(self.run_config)
        self._data: OrderedDict[tuple[int, int, Hashable], tuple[ClientData, int]] = OrderedDict()
        self._data_bytes = 0
        self._pools: dict[Hashable, ModelPool] = {}
        self._lock = threading.Lock()

    def serves(self, run_id: int, run_config: Mapping[str, Any]) -> bool:
        return run_id == self.run_id and run_config == self.run_config

    def client_data(self, partition_id: int, num_partitions: int, load: Callable[[], ClientData],
                    source: Hashable = None) -> ClientData:
        """The partition's data, loaded on first use; ``source`` tells apart data of one partition
        from different places (a node's own files; None: the run's dataset)."""
        key = (partition_id, num_partitions, source)
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
