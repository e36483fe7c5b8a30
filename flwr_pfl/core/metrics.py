"""Summaries of client metrics across a federation.

Personalized FL is judged per client, so a mean alone hides what matters: every metric is
reported as its sample-weighted mean, unweighted mean, min, max and standard deviation across
clients. Per-domain figures are pooled exactly from each client's per-domain counts, then
summarised across domains (FedDAR reports the min and the average over domains).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

_DOMAIN_KEY = re.compile(r"^(?P<prefix>.*?)(?P<kind>acc|loss)_d(?P<m>\d+)$")


#: the evaluation metric (1.0) of a classifier that predicted one class for every test sample
#: although the samples have several: the model has collapsed (a diverged or stalled training,
#: a head that cannot separate the features); the strategies warn when every client reports it
ONE_CLASS = "one_class_predicted"


def summarize(values: Sequence[float], weights: Sequence[float] | None = None) -> dict[str, float]:
    """Weighted mean (``wmean``), ``mean``, ``min``, ``max`` and population ``std`` of values.

    Non-finite values are left out (and counted in ``n_nonfinite``) so that one diverged client
    does not hide everyone else's numbers.
    """
    v = np.asarray(values, dtype=np.float64)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    if v.shape != w.shape:
        raise ValueError(f"{v.size} values but {w.size} weights")
    finite = np.isfinite(v)
    out = {"n_nonfinite": float((~finite).sum())}
    v, w = v[finite], w[finite]
    if v.size == 0:
        return out | {k: math.nan for k in ("wmean", "mean", "min", "max", "std")}
    wmean = float(np.average(v, weights=w)) if w.sum() > 0 else float(v.mean())
    return out | {
        "wmean": wmean,
        "mean": float(v.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
        "std": float(v.std()),
    }


def domain_metrics(client_metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Pool per-domain accuracy/loss over clients, weighting each client by its domain count.

    Clients report ``n_d<m>`` with ``acc_d<m>`` / ``loss_d<m>`` (optionally behind a prefix such
    as ``global_``). Returns ``<prefix><kind>_d<m>`` for each domain present, plus the worst
    domain (``<prefix>acc_domain_min``, ``<prefix>loss_domain_max``) and
    ``<prefix><kind>_domain_mean`` across domains.
    """
    sums: dict[tuple[str, str, int], list[float]] = {}
    for metrics in client_metrics:
        for key, value in metrics.items():
            match = _DOMAIN_KEY.match(key)
            if not match:
                continue
            prefix, kind, m = match["prefix"], match["kind"], int(match["m"])
            n = float(metrics.get(f"{prefix}n_d{m}", 0.0))
            if n <= 0 or not math.isfinite(float(value)):
                continue
            acc = sums.setdefault((prefix, kind, m), [0.0, 0.0])
            acc[0] += n * float(value)
            acc[1] += n
    out: dict[str, float] = {}
    per_kind: dict[tuple[str, str], list[float]] = {}
    for (prefix, kind, m), (total, n) in sorted(sums.items()):
        out[f"{prefix}{kind}_d{m}"] = total / n
        per_kind.setdefault((prefix, kind), []).append(total / n)
    for (prefix, kind), values in per_kind.items():
        out[f"{prefix}{kind}_domain_min" if kind == "acc" else f"{prefix}{kind}_domain_max"] = (
            min(values) if kind == "acc" else max(values)
        )
        out[f"{prefix}{kind}_domain_mean"] = float(np.mean(values))
    return out


def aggregate_client_metrics(
    results: Sequence[tuple[int, Mapping[str, float]]],
    keys: Sequence[str] | None = None,
) -> dict[str, float]:
    """Summarise clients' scalar metrics: ``<key>_<stat>`` for every numeric key, plus domains.

    Args:
        results: (num_examples, metrics) per client.
        keys: which metrics to summarise; default: every numeric key that is not a per-domain
            figure (``*_d<m>``) nor bookkeeping (``partition_id``).

    Returns:
        A flat dict: e.g. ``accuracy_wmean``, ``accuracy_min``, ... , ``acc_d0``,
        ``acc_domain_min``, and ``num_clients``.
    """
    if keys is None:
        found = {
            k
            for _, m in results
            for k, v in m.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        keys = sorted(
            k for k in found if not _DOMAIN_KEY.match(k) and not re.search(r"n_d\d+$", k) and k != "partition_id"
        )
    out: dict[str, float] = {"num_clients": float(len(results))}
    for key in keys:
        pairs = [(float(m[key]), n) for n, m in results if key in m]
        if not pairs:
            continue
        stats = summarize([v for v, _ in pairs], [n for _, n in pairs])
        out.update({f"{key}_{stat}": value for stat, value in stats.items() if stat != "n_nonfinite" or value})
    out.update(domain_metrics([m for _, m in results]))
    return out
