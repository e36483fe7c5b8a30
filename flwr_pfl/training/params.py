"""Named parameter groups of an encoder + heads model, to and from ordered lists of NumPy arrays.

Groups: ``all`` (the whole state_dict), ``heads`` (every head), ``head:<m>`` (head m) and
``body`` (everything that is not a head: the encoder). The model says which ``state_dict`` keys
are head keys through its ``in_head(key, index)`` method
(:class:`~flwr_pfl.models.EncoderHeadModel`, and :class:`~flwr_pfl.models.HeadSplit` for a
user's own model); any model has the group ``all``. Arrays follow the model's ``state_dict()``
order, buffers included (so BatchNorm statistics travel with their layer); that order is the wire
layout every strategy documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

NDArrays = list[np.ndarray]


def _member(model: nn.Module, group: str) -> Callable[[str], bool]:
    """Whether a state_dict key (or parameter name) of ``model`` belongs to ``group``."""
    if group == "all":
        return lambda key: True
    index = int(group[5:]) if group.startswith("head:") and group[5:].isdigit() else None
    if group not in ("body", "heads") and index is None:
        raise ValueError(f"unknown parameter group {group!r}; allowed: all, body, heads, head:<m>")
    in_head = getattr(model, "in_head", None)
    if in_head is None:
        raise ValueError(
            f"parameter group {group!r} needs a model split into body and head(s); this "
            f"{type(model).__name__} is not: name its head with "
            "flwr_pfl.models.split_model(model, head=...) (or pass head= to the client)"
        )
    if group == "body":
        return lambda key: not in_head(key)
    return lambda key: in_head(key, index)


def group_keys(model: nn.Module, group: str) -> list[str]:
    """The state_dict keys of ``group``, in state_dict order."""
    member = _member(model, group)
    keys = [k for k in model.state_dict() if member(k)]
    if not keys:
        raise ValueError(f"parameter group {group!r} is empty for this model")
    return keys


def get_arrays(model: nn.Module, group: str = "all") -> NDArrays:
    """Copies of the group's tensors as NumPy arrays (on the CPU), in wire order."""
    return arrays_of_keys(model, group_keys(model, group))


def arrays_of_keys(model: nn.Module, keys: Sequence[str]) -> NDArrays:
    """Copies of the ``state_dict`` entries ``keys`` as NumPy arrays (on the CPU), in that order."""
    state = model.state_dict()
    return [state[k].detach().cpu().numpy().copy() for k in keys]


def set_arrays(model: nn.Module, arrays: Sequence[np.ndarray], group: str = "all") -> None:
    """Load ``arrays`` into the group's tensors, checking their number and shapes.

    Raises:
        ValueError: naming the first array whose shape differs, or the count mismatch.
    """
    set_arrays_of_keys(model, group_keys(model, group), arrays, what=f"parameter group {group!r}")


def set_arrays_of_keys(model: nn.Module, keys: Sequence[str], arrays: Sequence[np.ndarray], what: str) -> None:
    """Load ``arrays`` into the ``state_dict`` entries ``keys`` (in that order), checking their
    number and shapes first, so that a refused load changes nothing; ``what`` names the entries
    in the error."""
    if len(arrays) != len(keys):
        raise ValueError(f"{what} has {len(keys)} tensors but {len(arrays)} arrays were given")
    state = model.state_dict()
    for key, array in zip(keys, arrays):
        if tuple(array.shape) != tuple(state[key].shape):
            raise ValueError(
                f"array for {key!r} has shape {tuple(array.shape)}, expected {tuple(state[key].shape)}"
            )
    with torch.no_grad():
        for key, array in zip(keys, arrays):
            state[key].copy_(torch.as_tensor(np.asarray(array)))


def buffer_flags(model: nn.Module) -> list[bool]:
    """One flag per ``state_dict`` entry (wire order): True for ``named_buffers`` entries (running
    statistics, counters), which a server step that moves parameters (FedGP's projection,
    pFedMe's beta step) must leave to the plain average."""
    buffers = {name for name, _ in model.named_buffers()}
    return [key in buffers for key in model.state_dict()]


def group_shapes(model: nn.Module, group: str = "all") -> list[tuple[int, ...]]:
    """Shapes of the group's arrays in wire order (what a strategy validates replies against)."""
    state = model.state_dict()
    return [tuple(state[k].shape) for k in group_keys(model, group)]


def group_parameters(model: nn.Module, groups: Sequence[str]) -> list[nn.Parameter]:
    """The trainable parameters (not buffers) that belong to any of ``groups``."""
    members = [_member(model, g) for g in groups]
    return [p for name, p in model.named_parameters() if any(member(name) for member in members)]


@contextmanager
def only_trainable(model: nn.Module, groups: Sequence[str]) -> Iterator[list[nn.Parameter]]:
    """Freeze every parameter outside ``groups`` for the duration of the block.

    Yields the parameters that stay trainable (to hand to an optimizer). Restores each
    parameter's previous ``requires_grad`` on exit.
    """
    previous = {name: p.requires_grad for name, p in model.named_parameters()}
    trainable = group_parameters(model, groups)
    trainable_ids = {id(p) for p in trainable}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable_ids)
    try:
        yield trainable
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(previous[name])
