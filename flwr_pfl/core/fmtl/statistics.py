"""Per-task feature statistics of one client under the frozen representation.

:func:`task_statistics` computes, per held task, the second moment Lambda_hat_i^c and (with
real-valued targets) the cross moment; :class:`TaskStatistics` validates them and carries them
over the wire. The server uses them for the eq. (10) weights (G_i^c of spec Sec. 3.3) and for
the linear closed form of eqs. (3)/(5)/(7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_pfl.core.fmtl.checks import ArrayLike, _check_num_tasks, _check_task_ids_np, _to_numpy


@dataclass(frozen=True)
class TaskStatistics:
    """One client's per-task feature statistics under the current (frozen) representation.

    Sent once the body is frozen (first phase-2 round), for the eq. (10) weights and for the
    linear closed form. Only held tasks appear (m_i rows).

    Attributes:
        tasks: (m_i,) int64 sorted task ids c in C_i.
        counts: (m_i,) int64 n_i^c >= 1.
        second_moments: (m_i, k, k) float64 Lambda_hat_i^c = (1/n_i^c) sum_{z in task c} z z^T
            (symmetric PSD; validated).
        cross_moments: (m_i, k) float64 (1/n_i^c) sum_{(z, y) in task c} z y, or None when the
            client has no real-valued targets (classification).
    """

    tasks: np.ndarray
    counts: np.ndarray
    second_moments: np.ndarray
    cross_moments: np.ndarray | None = None

    def __post_init__(self) -> None:
        tasks = np.asarray(self.tasks)
        counts = np.asarray(self.counts)
        sm = np.asarray(self.second_moments, dtype=np.float64)
        if tasks.ndim != 1 or tasks.size < 1 or not np.issubdtype(tasks.dtype, np.integer):
            raise ValueError(
                f"TaskStatistics.tasks must be a non-empty 1-D integer array, got {tasks!r}"
            )
        if np.any(tasks < 0) or np.unique(tasks).size != tasks.size or np.any(np.diff(tasks) < 0):
            raise ValueError(
                f"TaskStatistics.tasks must be sorted, unique and >= 0, got {tasks.tolist()}"
            )
        mi = tasks.size
        if counts.shape != (mi,) or not np.issubdtype(counts.dtype, np.integer) or np.any(counts < 1):
            raise ValueError(
                f"TaskStatistics.counts must be {mi} integers >= 1 (one per task), got {counts!r}"
            )
        if sm.ndim != 3 or sm.shape[0] != mi or sm.shape[1] != sm.shape[2] or sm.shape[1] < 1:
            raise ValueError(
                f"TaskStatistics.second_moments must have shape ({mi}, k, k), got {sm.shape}"
            )
        if not np.all(np.isfinite(sm)):
            raise ValueError("TaskStatistics.second_moments contain NaN or Inf")
        scale = max(1.0, float(np.abs(sm).max()))
        if np.abs(sm - sm.transpose(0, 2, 1)).max() > 1e-6 * scale:
            raise ValueError("TaskStatistics.second_moments are not symmetric (not second moments)")
        sm = 0.5 * (sm + sm.transpose(0, 2, 1))
        min_eig = np.linalg.eigvalsh(sm)[:, 0]
        if np.any(min_eig < -1e-6 * scale):
            bad = tasks[min_eig < -1e-6 * scale]
            raise ValueError(
                f"TaskStatistics.second_moments of task(s) {bad.tolist()} are not positive "
                "semi-definite (not second moments)"
            )
        cross = self.cross_moments
        if cross is not None:
            cross = np.asarray(cross, dtype=np.float64)
            if cross.shape != (mi, sm.shape[1]):
                raise ValueError(
                    f"TaskStatistics.cross_moments must have shape ({mi}, {sm.shape[1]}), "
                    f"got {cross.shape}"
                )
            if not np.all(np.isfinite(cross)):
                raise ValueError("TaskStatistics.cross_moments contain NaN or Inf")
        object.__setattr__(self, "tasks", tasks.astype(np.int64))
        object.__setattr__(self, "counts", counts.astype(np.int64))
        object.__setattr__(self, "second_moments", sm)
        object.__setattr__(self, "cross_moments", cross)

    @property
    def dim(self) -> int:
        """Feature dimension k."""
        return int(self.second_moments.shape[1])

    @property
    def num_examples(self) -> int:
        """n_i = sum_c n_i^c."""
        return int(self.counts.sum())

    def total_second_moment(self) -> np.ndarray:
        """S_i = Z_i Z_i^T / n_i = sum_c (n_i^c / n_i) Lambda_hat_i^c, shape (k, k).

        The Gram matrix of every augmented dataset of the client (Z~_i^c = Z_i for all c).
        """
        w = self.counts / self.num_examples
        return np.einsum("c,ckl->kl", w, self.second_moments)

    def moment_sum_excluding(self, task: int) -> np.ndarray:
        """G_i^c = sum_{c' in C_i, c' != c} Lambda_hat_i^{c'} (spec Sec. 3.3), shape (k, k).

        Client i's contribution to Lambda_beta^{\\c} of eq. (10), per unit weight.
        """
        keep = self.tasks != task
        return self.second_moments[keep].sum(axis=0)

    def to_arrays(self) -> list[np.ndarray]:
        """The arrays that travel: [tasks, counts, second_moments(, cross_moments)]."""
        arrays = [self.tasks, self.counts, self.second_moments]
        if self.cross_moments is not None:
            arrays.append(self.cross_moments)
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], *, num_tasks: int | None = None,
                    dim: int | None = None) -> TaskStatistics:
        """Rebuild (and validate) statistics received as arrays from :meth:`to_arrays`.

        Args:
            arrays: 3 or 4 arrays as written by :meth:`to_arrays`.
            num_tasks: if given, task ids must be < num_tasks.
            dim: if given, the feature dimension must equal it.
        """
        if len(arrays) not in (3, 4):
            raise ValueError(
                f"TaskStatistics arrays must be [tasks, counts, second_moments(, cross_moments)], "
                f"got {len(arrays)} arrays"
            )
        st = cls(*arrays)
        if num_tasks is not None and st.tasks.max() >= num_tasks:
            raise ValueError(f"TaskStatistics name task {int(st.tasks.max())} >= num_tasks={num_tasks}")
        if dim is not None and st.dim != dim:
            raise ValueError(f"TaskStatistics have feature dimension {st.dim}, expected {dim}")
        return st


def task_statistics(
    features: ArrayLike, task_ids: ArrayLike, num_tasks: int, targets: ArrayLike | None = None
) -> TaskStatistics:
    """Per-task feature second moments (and cross moments) of one client (client side).

    Computed in float64 from the features z = phi(x) of the frozen representation.

    Args:
        features: (n_i, k) features, numpy or torch.
        task_ids: (n_i,) integer task of each sample.
        num_tasks: M.
        targets: optional (n_i,) real labels (linear regression) for the cross moments.

    Returns:
        :class:`TaskStatistics` over the tasks present locally.
    """
    _check_num_tasks(num_tasks)
    z = np.asarray(_to_numpy(features, "features"), dtype=np.float64)
    ids = np.asarray(_to_numpy(task_ids, "task_ids"))
    if z.ndim != 2 or z.shape[0] < 1:
        raise ValueError(
            f"features must have shape (n_i, k) with n_i >= 1 (a client with no samples has no "
            f"statistics), got {z.shape}"
        )
    if ids.shape != (z.shape[0],):
        raise ValueError(f"task_ids must have shape ({z.shape[0]},), got {ids.shape}")
    _check_task_ids_np(ids, num_tasks)
    if not np.all(np.isfinite(z)):
        raise ValueError("features contain NaN or Inf")
    counts = np.bincount(ids, minlength=num_tasks)
    tasks = np.flatnonzero(counts)
    onehot = (ids[:, None] == tasks[None, :]).astype(np.float64)  # (n, m_i)
    inv = 1.0 / counts[tasks]
    n, k = z.shape
    per_task = (onehot[:, :, None] * z[:, None, :]).reshape(n, tasks.size * k)
    second = (per_task.T @ z).reshape(tasks.size, k, k) * inv[:, None, None]
    cross = None
    if targets is not None:
        y = np.asarray(_to_numpy(targets, "targets"), dtype=np.float64)
        if y.shape != (z.shape[0],):
            raise ValueError(f"targets must have shape ({z.shape[0]},), got {y.shape}")
        if not np.all(np.isfinite(y)):
            raise ValueError("targets contain NaN or Inf")
        cross = (onehot.T @ (z * y[:, None])) * inv[:, None]
    return TaskStatistics(tasks, counts[tasks].astype(np.int64), second, cross)
