"""Why FedDAR-SA through the app ends higher than the core Fig. 1 simulation: one factor at a time.

The core reference simulation (``flwr_pfl.data.synthetic.feddar.run_fig1``, used by
tests/core/test_feddar.py) and the app preset ``feddar_synthetic.toml`` differ in several
settings. This script runs Algorithm 1 (exact local heads, SA, u-re-weighted encoder GD) on the
core functions with the app's settings, then changes one setting at a time to the core's, over
several seeds, and prints the final test MSE (log10 mean and per seed) as Markdown.

    python simulations/feddar_stall.py --seeds 0 1 2 3 4 --out docs/reproduce/feddar_stall.json

Settings (app preset -> core reference):
  clients / samples    n = 20, L = 20                -> n = 100, L = 10
  mixture              Dir(alpha p) (0.08 per domain) -> Dir(0.4) per domain
  encoder lr           0.2                           -> 0.5
  initialisation       nn.Linear default (B ~ U(+-1/sqrt(d)), heads ~ U(+-1/sqrt(k)))
                                                     -> B ~ N(0, 1), heads ~ N(0, 1)
  precision            float32                       -> float64
  rounds               60                            -> 300
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from flwr_pfl.core import feddar as core
from flwr_pfl.data.synthetic import feddar as S


@dataclass(frozen=True)
class Setting:
    """One configuration of the Fig. 1 FedDAR-SA run."""

    clients: int = 20
    samples: int = 20
    concentration: S.MixtureConcentration = S.MixtureConcentration.ALPHA_TIMES_PRIOR
    lr: float = 0.2
    init: str = "torch_default"  # or "normal"
    dtype: str = "float32"
    rounds: int = 60


APP = Setting()
CORE = Setting(100, 10, S.MixtureConcentration.ALPHA_PER_DOMAIN, 0.5, "normal", "float64", 300)


def _init(setting: Setting, d: int, k: int, m: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if setting.init == "normal":
        return torch.randn(d, k, generator=gen, dtype=dtype), torch.randn(m, k, generator=gen, dtype=dtype)
    # nn.Linear's default (kaiming uniform with a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    rep = (torch.rand(d, k, generator=gen, dtype=dtype) * 2 - 1) / math.sqrt(d)
    heads = (torch.rand(m, k, generator=gen, dtype=dtype) * 2 - 1) / math.sqrt(k)
    return rep, heads


def run(setting: Setting, seed: int) -> list[float]:
    """Test MSE per round of FedDAR-SA under ``setting`` (core functions, all clients each round)."""
    dtype = getattr(torch, setting.dtype)
    data = S.make_feddar_synthetic(num_clients=setting.clients, samples_per_client=setting.samples,
                                   concentration=setting.concentration, seed=seed, dtype=dtype)
    num_domains, k = data.problem.heads_star.shape
    rep, heads = _init(setting, data.train.x.shape[-1], k, num_domains, seed, dtype)
    u = core.domain_weights(core.domain_counts(data.train.z, num_domains).numpy())
    config = S.Fig1Config(rounds=setting.rounds, rep_lr=setting.lr, seed=seed)
    layout = core.HeadLayout(1, k)
    history = []
    for _ in range(setting.rounds):
        rep, heads = S._feddar_round(rep, heads, data, u, core.HeadAggregation.SA, config)
        rep, heads = rep.to(dtype), heads.to(dtype)
        pred = core.head_outputs(data.test.x @ rep, data.test.z, heads, layout)
        history.append(float(((pred.reshape(data.test.y.shape) - data.test.y) ** 2).mean()))
    return history


VARIANTS: dict[str, Setting] = {
    "app settings": APP,
    "app, N(0,1) init": replace(APP, init="normal"),
    "app, lr 0.5": replace(APP, lr=0.5),
    "app, float64": replace(APP, dtype="float64"),
    "app, Dir(0.4) per domain": replace(APP, concentration=S.MixtureConcentration.ALPHA_PER_DOMAIN),
    "app, n=100 L=10": replace(APP, clients=100, samples=10),
    "app, 300 rounds": replace(APP, rounds=300),
    "app, N(0,1) init + lr 0.5": replace(APP, init="normal", lr=0.5),
    "core reference, 60 rounds": replace(CORE, rounds=60),
    "core reference": CORE,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    print("| setting | log10 MSE mean ± std | final MSE per seed | rounds to < 1e-6 (per seed) |")
    print("|---|---|---|---|")
    for name, setting in VARIANTS.items():
        curves = [run(setting, s) for s in args.seeds]
        final = np.array([c[-1] for c in curves])
        hit = [next((i + 1 for i, v in enumerate(c) if v < 1e-6), None) for c in curves]
        logs = np.log10(final)
        results[name] = {"setting": {k: str(v) for k, v in setting.__dict__.items()}, "final": final.tolist(),
                         "rounds_to_1e-6": hit, "curves": curves}
        print(f"| {name} | {logs.mean():.2f} ± {logs.std(ddof=1):.2f} | "
              + " / ".join(f"{v:.1e}" for v in final) + " | " + " / ".join(str(h) for h in hit) + " |", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"seeds": args.seeds, "results": results}))


if __name__ == "__main__":
    main()
