"""simulations/fedgp_noise_robustness.py: the four training protocols do what their names say."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import fedgp_noise_robustness as N  # noqa: E402


def _data(n: int = 96, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 6, 6, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0.5).long() + 2 * (x[:, 0, 0, 0] > 0.5).long()
    return x, y


def _make() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 4))


def _train(protocol: str, **kw) -> dict[str, torch.Tensor]:
    x, y = _data()
    options = dict(protocol=protocol, epochs=3, seed=0, batch_size=8, lr=0.05)
    options.update(kw)
    return N.train(_make, x, y, lambda v: v, **options).state_dict()


def _same(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_fedavg_with_one_client_is_central_training_with_a_fresh_adam_each_round():
    # one client holding everything, restarting Adam every round = central training whose
    # optimizer restarts once per epoch (96 images / batch 8 = 12 steps, the reset period)
    fed = _train("fedavg", clients=1)
    reset = _train("central-reset", steps_per_round=12)
    assert _same(fed, reset)
    # and a run that keeps its optimizer is a different run: the restart is what the test sees
    assert not _same(fed, _train("central"))


def test_fedavg_averages_the_clients_models_by_their_share():
    x, y = _data(n=90)
    seen: list[dict] = []
    original = N.one_epoch

    def spy(model, optimizer, xs, ys, scale, g, batch_size, reset_every=0):
        original(model, optimizer, xs, ys, scale, g, batch_size, reset_every)
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        seen[-1]["_n"] = len(xs)

    N.one_epoch = spy
    try:
        model = N.train(_make, x, y, lambda v: v, protocol="fedavg", epochs=1, seed=0, clients=4, batch_size=8)
    finally:
        N.one_epoch = original
    sizes = [s["_n"] for s in seen]
    assert sizes == [23, 23, 22, 22]  # unequal shares, so a plain mean would be wrong
    for k, v in model.state_dict().items():
        expected = sum(s[k] * s["_n"] for s in seen) / 90
        assert torch.allclose(v, expected, atol=1e-6)


def test_keeping_each_clients_adam_state_changes_the_second_round_only():
    one_fresh = _train("fedavg", clients=3, epochs=1)
    one_kept = _train("fedavg-keep-adam", clients=3, epochs=1)
    assert _same(one_fresh, one_kept)  # round 1: nothing kept yet
    assert not _same(_train("fedavg", clients=3, epochs=2), _train("fedavg-keep-adam", clients=3, epochs=2))


def test_an_unknown_protocol_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="central-reset"):
        _train("fedprox")


def test_evaluate_reports_accuracy_and_loss_of_the_noisy_inputs():
    x, y = _data()
    model = _make()
    acc, loss = N.evaluate(model, x, y, 0.0, lambda v: v, seed=0)
    with torch.no_grad():
        logits = model(x)
    assert acc == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert loss == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
    # noise is drawn from the seed: the same seed gives the same figure, another a different one
    assert N.evaluate(model, x, y, 0.8, lambda v: v, seed=1) == N.evaluate(model, x, y, 0.8, lambda v: v, seed=1)
    assert N.evaluate(model, x, y, 0.8, lambda v: v, seed=1)[1] != N.evaluate(model, x, y, 0.8, lambda v: v, seed=2)[1]
