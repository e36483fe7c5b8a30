"""Evaluation: the binary AUC (Mann-Whitney U), the metric of the paper's EXAM tables."""

from __future__ import annotations

import numpy as np


def binary_auc(scores, labels) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (Mann-Whitney U / (n+ n-),
    ties counted one half); NaN when only one class is present.

    Args:
        scores: (L,) real scores, higher meaning class 1.
        labels: (L,) in {0, 1}.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    # average ranks over ties
    _, start, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
