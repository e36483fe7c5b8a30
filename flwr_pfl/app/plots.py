"""PNG plots of a run's learning curves (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import matplotlib
except ModuleNotFoundError as err:
    from flwr_pfl.errors import missing_extra

    raise missing_extra("matplotlib", "plots", "plotting learning curves") from err

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_learning_curves(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Accuracy (weighted mean with the min-max band across clients) and loss per round."""
    metrics = [m for m in ("accuracy", "loss") if any(f"{m}_wmean" in r for r in rows)]
    if not metrics:
        return  # no round has a weighted mean to draw
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        rounds, mean = _series(rows, f"{metric}_wmean")
        _, low = _series(rows, f"{metric}_min")
        _, high = _series(rows, f"{metric}_max")
        ax.plot(rounds, mean, marker="o", label="weighted mean")
        if len(low) == len(rounds) == len(high):
            ax.fill_between(rounds, low, high, alpha=0.2, label="min-max over clients")
        if metric == "accuracy" and any("global_accuracy_wmean" in r for r in rows):
            r2, g = _series(rows, "global_accuracy_wmean")
            ax.plot(r2, g, linestyle="--", label="global model")
        ax.set_xlabel("round")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_domains(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Accuracy of each domain (pooled over clients) per round."""
    domains = sorted({k for r in rows for k in r if k.startswith("acc_d") and k[5:].isdigit()}, key=lambda k: int(k[5:]))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key in domains:
        ax.plot(*_series(rows, key), marker=".", label=f"domain {key[5:]}")
    ax.plot(*_series(rows, "acc_domain_min"), color="black", linestyle="--", label="min over domains")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
