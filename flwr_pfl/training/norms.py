"""What a frozen part of the model does with its normalisation statistics during training.

Freezing a part (FedRep's body while its head trains, FMTL's body in phase 2, ...) turns off the
gradients of its parameters, but a BatchNorm layer also changes in the forward pass: in train
mode it normalises with the batch's statistics and moves its running mean and variance towards
them. A body "frozen" that way still changes the representation its head is being fitted to,
and the statistics it sends back (BatchNorm buffers travel with their layer) have drifted.

``frozen-norm`` decides, for the normalisation modules that keep running statistics
(:func:`running_stat_norms`: BatchNorm1d/2d/3d, SyncBatchNorm, their lazy forms, and
InstanceNorm with ``track_running_stats=True``) and lie wholly in the frozen part
(:func:`frozen_norm_modules`):

* ``eval`` (the default): they are in eval mode for the phase, so they normalise with their
  running statistics, as at evaluation, and leave them untouched: a frozen part is frozen.
* ``train``: they stay in train mode, as the reference implementations do (FedRep's official
  code, PFLlib and FL-bench put the whole network in train mode and freeze by
  ``requires_grad``): their statistics move with every batch.

GroupNorm, LayerNorm and InstanceNorm without running statistics behave the same in both modes
and are left alone. Dropout in a frozen part stays active under both settings: it still
regularises the part being trained, as in the reference implementations. A phase that trains
every parameter (group ``all``) freezes nothing and is unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from flwr_pfl.training.params import _member

#: the values of ``frozen-norm`` (see the module's docstring)
FrozenNorm = Literal["eval", "train"]
FROZEN_NORMS: tuple[str, ...] = ("eval", "train")


def check_frozen_norm(value: str) -> None:
    """Raise ValueError unless ``value`` is one of :data:`FROZEN_NORMS`."""
    if value not in FROZEN_NORMS:
        raise ValueError(
            f"frozen-norm={value!r} is not allowed; choose 'eval' (a frozen part's BatchNorm "
            "statistics stay as they are) or 'train' (they move, as in the reference codes)"
        )


def running_stat_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every normalisation module of ``model`` that keeps running
    statistics (a ``_NormBase`` with ``track_running_stats``), in ``named_modules`` order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, _NormBase) and module.track_running_stats
    ]


def frozen_norm_modules(model: nn.Module, groups: Sequence[str]) -> list[nn.Module]:
    """The running-statistics normalisation modules that training ``groups`` leaves frozen:
    none of their ``state_dict`` entries (affine weight and bias, running statistics) belongs
    to any of ``groups``. Judging by every entry, buffers included, places a BatchNorm without
    affine parameters in the part that holds its statistics."""
    members = [_member(model, g) for g in groups]
    frozen = []
    for name, module in running_stat_norms(model):
        prefix = f"{name}." if name else ""
        keys = [prefix + key for key in module.state_dict()]
        if not any(member(key) for key in keys for member in members):
            frozen.append(module)
    return frozen


@contextmanager
def frozen_norms(model: nn.Module, groups: Sequence[str], frozen_norm: FrozenNorm = "eval") -> Iterator[list[nn.Module]]:
    """For the block, put the normalisation modules that training ``groups`` leaves frozen in
    eval mode (``frozen_norm="eval"``) or leave every mode as it is (``"train"``).

    Yields the modules switched to eval mode (empty under ``"train"``); each gets back its own
    train/eval mode on exit.

    Raises:
        ValueError: ``frozen_norm`` is not one of :data:`FROZEN_NORMS`.
    """
    check_frozen_norm(frozen_norm)
    switched = frozen_norm_modules(model, groups) if frozen_norm == "eval" else []
    modes = [module.training for module in switched]
    for module in switched:
        module.eval()
    try:
        yield switched
    finally:
        for module, training in zip(switched, modes):
            module.train(training)
