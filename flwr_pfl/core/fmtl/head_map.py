"""Which parameters of a model form the head of each task; everything else is the body.

A :class:`HeadMap` lists, per task, whole arrays (multi-head models) or rows of arrays (one
stacked ``Linear(k, M)``, the paper's class-as-task setup); :class:`HeadSlice` is one such piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fmtl.checks import _check_num_tasks, _is_int_at_least


@dataclass(frozen=True)
class HeadSlice:
    """A piece of a model parameter list that belongs to one task's head.

    Attributes:
        array: index of the array in the parameter list (the NumPy list on the wire).
        row: index along the array's first axis (row c of a stacked ``Linear(k, M)`` weight, or
            entry c of its bias), or None when the whole array belongs to the task.
    """

    array: int
    row: int | None = None


@dataclass(frozen=True)
class HeadMap:
    """Which parameters form the head of each task; everything else is body.

    ``slices[c]`` lists the pieces of task c's head. Two layouts (mixable):

    * stacked linear head (classification-as-tasks, the paper's CIFAR setup, spec P4): one
      ``Linear(k, M)``; task c owns row c of the weight and entry c of the bias
      (:meth:`stacked_linear`);
    * multi-head: task c owns whole arrays (:meth:`per_task_arrays`).

    The structure is checked on construction (every task owns something, no piece is owned
    twice); :meth:`validate` checks it against a model's array shapes.
    """

    slices: tuple[tuple[HeadSlice, ...], ...]

    def __post_init__(self) -> None:
        slices = tuple(tuple(s) for s in self.slices)
        if not slices:
            raise ValueError("HeadMap needs at least one task")
        whole: dict[int, int] = {}
        rows: dict[tuple[int, int], int] = {}
        row_arrays: dict[int, int] = {}
        for c, pieces in enumerate(slices):
            if not pieces:
                raise ValueError(f"HeadMap: task {c} owns no parameters")
            for p in pieces:
                if not isinstance(p, HeadSlice):
                    raise ValueError(f"HeadMap: task {c} has {p!r}, expected HeadSlice")
                if not _is_int_at_least(p.array, 0):
                    raise ValueError(
                        f"HeadMap: task {c} names array index {p.array!r}; must be an int >= 0"
                    )
                if p.row is None:
                    if p.array in whole or p.array in row_arrays:
                        raise ValueError(
                            f"HeadMap: array {p.array} is claimed by task {c} and another piece"
                        )
                    whole[p.array] = c
                else:
                    if not _is_int_at_least(p.row, 0):
                        raise ValueError(
                            f"HeadMap: task {c} names row {p.row!r} of array {p.array}; "
                            "must be an int >= 0"
                        )
                    key = (int(p.array), int(p.row))
                    if key in rows or p.array in whole:
                        raise ValueError(
                            f"HeadMap: row {p.row} of array {p.array} is claimed by task {c} "
                            "and another piece"
                        )
                    rows[key] = c
                    row_arrays[int(p.array)] = c
        object.__setattr__(self, "slices", slices)

    @classmethod
    def stacked_linear(
        cls, num_tasks: int, weight_index: int, bias_index: int | None = None
    ) -> HeadMap:
        """Task c = row c of the weight (M, k) and entry c of the bias (M,) (spec P4).

        ``bias_index=None`` for a head layer without bias.
        """
        _check_num_tasks(num_tasks)
        rows = []
        for c in range(num_tasks):
            pieces = [HeadSlice(weight_index, c)]
            if bias_index is not None:
                pieces.append(HeadSlice(bias_index, c))
            rows.append(tuple(pieces))
        return cls(tuple(rows))

    @classmethod
    def per_task_arrays(cls, arrays_per_task: Sequence[Sequence[int]]) -> HeadMap:
        """Task c owns the whole arrays ``arrays_per_task[c]`` (multi-head models)."""
        return cls(tuple(tuple(HeadSlice(int(a)) for a in arrays) for arrays in arrays_per_task))

    @property
    def num_tasks(self) -> int:
        """M."""
        return len(self.slices)

    def head_array_indices(self) -> tuple[int, ...]:
        """Sorted indices of the arrays that hold (part of) a head: what phase 2 trains/uploads."""
        return tuple(sorted({p.array for pieces in self.slices for p in pieces}))

    def body_array_indices(self, num_arrays: int) -> tuple[int, ...]:
        """Indices of the arrays no head touches (the representation)."""
        heads = set(self.head_array_indices())
        return tuple(i for i in range(num_arrays) if i not in heads)

    def validate(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Check the map against a model's array shapes; raise ValueError if it does not fit."""
        n = len(shapes)
        for c, pieces in enumerate(self.slices):
            for p in pieces:
                if p.array >= n:
                    raise ValueError(
                        f"HeadMap: task {c} names array {p.array}, but the model has {n} "
                        f"arrays (0..{n - 1})"
                    )
                if p.row is not None:
                    shape = tuple(shapes[p.array])
                    if len(shape) == 0:
                        raise ValueError(
                            f"HeadMap: task {c} names a row of array {p.array}, which is a scalar"
                        )
                    if p.row >= shape[0]:
                        raise ValueError(
                            f"HeadMap: task {c} names row {p.row} of array {p.array} with shape {shape} "
                            f"(rows 0..{shape[0] - 1})"
                        )

    def row_owners(self, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """Owner task of every row of every array (-1 = body), after :meth:`validate`.

        Arrays owned whole, and body arrays, have a single entry (they are treated as one row).
        """
        self.validate(shapes)
        owners: list[np.ndarray] = [np.array([-1]) for _ in shapes]
        for c, pieces in enumerate(self.slices):
            for p in pieces:
                if p.row is None:
                    owners[p.array] = np.array([c])
                else:
                    if owners[p.array].shape[0] != shapes[p.array][0]:
                        owners[p.array] = np.full(shapes[p.array][0], -1)
                    owners[p.array][p.row] = c
        return owners
