"""Optimizers and learning-rate schedulers from config, by their ``torch.optim`` names.

Any optimizer class of :mod:`torch.optim` is accepted by name, case-insensitively (``sgd``,
``adamw``, ``rmsprop``, ...), with its own keyword options; likewise any scheduler of
:mod:`torch.optim.lr_scheduler` (``steplr``, ``onecyclelr``, ...). Names and options are checked
when the config is built, by constructing the optimizer (and scheduler) on a dummy parameter, so
a typo or a bad value stops a run before any training, with a message that lists what is valid.

Scheduling. The training loop builds a fresh optimizer for every call (every round, every phase),
so a scheduler spans one call: it starts from the configured learning rate and is stepped after
**every optimizer step**. Per step, because a round's local training is often a single epoch (a
per-epoch scheduler would never move within it), because warm-up and one-cycle schedules are
defined per step, and because it needs nothing from the loop's structure (``max_steps``,
per-step recording). Schedules over rounds belong to the server: a strategy's
``on_fit_config_fn`` can send a ``learning-rate`` per round, which replaces ``learning_rate``
for that round (see :mod:`flwr_pfl.clients.base`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim import lr_scheduler

from flwr_pfl.errors import ConfigError

#: option pairs, sorted by name (hashable, so configs can be compared and cached)
Options = tuple[tuple[str, Any], ...]

#: torch.optim optimizers the training loop cannot drive, and why
REFUSED_OPTIMIZERS = {
    "lbfgs": "LBFGS needs a closure that re-evaluates the loss at every step, which the training loop does not give",
    "sparseadam": "SparseAdam needs sparse gradients; the suite's models produce dense ones",
    "muon": "Muon optimizes 2-D weight matrices only and needs a second optimizer for the other parameters",
}
#: torch.optim.lr_scheduler schedulers that cannot be stepped per optimizer step from options, and why
REFUSED_SCHEDULERS = {
    "reducelronplateau": "ReduceLROnPlateau needs a validation metric at every step, which local training does not compute",
    "sequentiallr": "SequentialLR takes other scheduler objects, not options",
    "chainedscheduler": "ChainedScheduler takes other scheduler objects, not options",
}
#: arguments set by OptimizerConfig's own fields, never through ``options``
OWN_ARGUMENTS = {
    "params": "",
    "lr": "learning_rate (run config: learning-rate)",
    "momentum": "momentum",
    "weight_decay": "weight_decay (run config: weight-decay)",
}


def _classes(module: Any, base: type) -> dict[str, type]:
    """Lower-case name -> class of every public subclass of ``base`` in ``module``."""
    return {
        name.lower(): cls
        for name, cls in vars(module).items()
        if isinstance(cls, type) and issubclass(cls, base) and cls is not base and not name.startswith("_")
    }


OPTIMIZER_CLASSES = {k: v for k, v in _classes(torch.optim, torch.optim.Optimizer).items() if k not in REFUSED_OPTIMIZERS}
SCHEDULER_CLASSES = {
    k: v
    for k, v in (_classes(lr_scheduler, lr_scheduler.LRScheduler) | {"reducelronplateau": lr_scheduler.ReduceLROnPlateau}).items()
    if k not in REFUSED_SCHEDULERS
}
#: the optimizer names accepted (lower case)
OPTIMIZERS = tuple(sorted(OPTIMIZER_CLASSES))
#: the scheduler names accepted (lower case); "" means no scheduler
SCHEDULERS = tuple(sorted(SCHEDULER_CLASSES))


def _lookup(kind: str, name: str, classes: dict[str, type], refused: dict[str, str]) -> type:
    key = name.lower()
    if key in refused:
        raise ConfigError(f"{kind}={name!r} is not supported: {refused[key]}; allowed: {', '.join(sorted(classes))}")
    if key not in classes:
        close = difflib.get_close_matches(key, list(classes), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            f"{kind}={name!r} is unknown{hint}; allowed (torch names, any case): {', '.join(sorted(classes))}"
        )
    return classes[key]


def _keywords(cls: type, skip: int) -> list[str]:
    """The keyword arguments of ``cls``'s constructor after its first ``skip`` parameters."""
    params = list(inspect.signature(cls).parameters.values())[skip:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _normalize(kind: str, options: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Options:
    """``options`` as sorted (name, value) pairs; lists become tuples so that they hash."""
    pairs = options.items() if isinstance(options, Mapping) else options
    out = []
    for key, value in pairs:
        if not isinstance(key, str):
            raise ConfigError(f"{kind} option names must be strings, got {key!r}")
        if any(key == seen for seen, _ in out):
            raise ConfigError(f"{kind} option {key!r} is given twice")
        out.append((key, tuple(value) if isinstance(value, list) else value))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _check_options(kind: str, cls: type, options: Options, allowed: list[str], own: dict[str, str]) -> None:
    """Refuse option names ``cls`` does not take (listing those it does) and the ones set elsewhere."""
    for key, _ in options:
        if key in own:
            where = f": set it with {own[key]}" if own[key] else ""
            raise ConfigError(f"{cls.__name__}'s {key!r} cannot be set in the {kind} options{where}")
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"{cls.__name__} has no option {key!r}{hint}; its options: {', '.join(a for a in allowed if a not in own)}"
            )


def _try(kind: str, cls: type, build: Any) -> Any:
    """Call ``build()``; turn torch's complaint about a value (or a missing required option)
    into a ConfigError naming ``cls`` and its options."""
    try:
        return build()
    except (TypeError, ValueError, RuntimeError) as err:
        options = ", ".join(k for k in _keywords(cls, 1) if k not in OWN_ARGUMENTS)
        raise ConfigError(f"{kind} {cls.__name__} refused its settings: {err} (its options: {options})") from None


def _dummy_parameter() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(2, 2))


@dataclass(frozen=True)
class OptimizerConfig:
    """Local optimizer settings (run-config keys ``optimizer``, ``learning-rate``, ``momentum``,
    ``weight-decay``, ``optimizer-options``, ``lr-scheduler``, ``lr-scheduler-options``).

    Attributes:
        name: a :mod:`torch.optim` optimizer class name, any case (``sgd``, ``adam``, ``adamw``,
            ``rmsprop``, ...); LBFGS, SparseAdam and Muon are refused (see
            ``REFUSED_OPTIMIZERS``).
        learning_rate: the ``lr`` argument (> 0).
        momentum: the ``momentum`` argument of optimizers that take one (SGD, RMSprop);
            optimizers without one ignore it, as Adam always has (their moment settings, e.g.
            Adam's ``betas``, are ``options``).
        weight_decay: the ``weight_decay`` argument, passed as given (0 by default, also for
            AdamW, whose own default is 0.01); must be 0 for optimizers without one.
        options: further keyword arguments of the optimizer, e.g. ``{"betas": (0.9, 0.99)}``.
        scheduler: a :mod:`torch.optim.lr_scheduler` class name, any case (``""``: none);
            stepped after every optimizer step (module docstring).
        scheduler_options: its keyword arguments, e.g. ``{"step_size": 10, "gamma": 0.5}``.
    """

    name: str = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    options: Options | Mapping[str, Any] = ()
    scheduler: str = ""
    scheduler_options: Options | Mapping[str, Any] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"optimizer={self.name!r} must be a name (a string)")
        cls = _lookup("optimizer", self.name, OPTIMIZER_CLASSES, REFUSED_OPTIMIZERS)
        object.__setattr__(self, "name", self.name.lower())
        object.__setattr__(self, "options", _normalize("optimizer", self.options))
        object.__setattr__(self, "scheduler_options", _normalize("lr-scheduler", self.scheduler_options))
        object.__setattr__(self, "scheduler", self.scheduler.lower())
        if not self.learning_rate > 0:
            raise ConfigError(f"OptimizerConfig(learning_rate=...) (run config learning-rate) must be > 0, got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"OptimizerConfig(weight_decay=...) (run config weight-decay) must be >= 0, got {self.weight_decay}")
        if self.weight_decay and "weight_decay" not in _keywords(cls, 1):
            raise ConfigError(f"{cls.__name__} has no weight decay; set weight-decay to 0 (got {self.weight_decay})")
        _check_options("optimizer", cls, self.options, _keywords(cls, 1), OWN_ARGUMENTS)
        if self.scheduler_options and not self.scheduler:
            raise ConfigError("lr-scheduler-options are set but no lr-scheduler is named")
        if self.scheduler:
            sched = _lookup("lr-scheduler", self.scheduler, SCHEDULER_CLASSES, REFUSED_SCHEDULERS)
            _check_options("lr-scheduler", sched, self.scheduler_options, _keywords(sched, 1), {"optimizer": ""})
        make_optimizer([_dummy_parameter()], self)  # torch checks the values (betas in [0, 1), ...)

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return OPTIMIZER_CLASSES[self.name]

    def scaled(self, factor: float) -> OptimizerConfig:
        """The same optimizer with the learning rate multiplied by ``factor``."""
        return replace(self, learning_rate=self.learning_rate * factor)


def make_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """Build the optimizer ``config`` names over ``params``, with its scheduler (if any) stepped
    after every optimizer step (a post-step hook, so the loop needs no change)."""
    params = list(params)
    cls = config.optimizer_class
    accepted = _keywords(cls, 1)
    kwargs: dict[str, Any] = {"lr": config.learning_rate}
    if "momentum" in accepted:
        kwargs["momentum"] = config.momentum
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = config.weight_decay
    optimizer = _try("optimizer", cls, lambda: cls(params, **kwargs, **dict(config.options)))
    if config.scheduler:
        scheduler = make_scheduler(optimizer, config)
        optimizer.register_step_post_hook(lambda opt, args, kw: scheduler.step())
    return optimizer


def make_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> lr_scheduler.LRScheduler:
    """The scheduler ``config`` names over ``optimizer`` (not yet hooked to its steps)."""
    cls = SCHEDULER_CLASSES[config.scheduler]
    return _try("lr-scheduler", cls, lambda: cls(optimizer, **dict(config.scheduler_options)))
