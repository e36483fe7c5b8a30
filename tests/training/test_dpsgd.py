"""DP-SGD (record-level DP): per-record gradients, clipping, noise, Poisson batches, the
accountant, and the train loop with it; closed forms and the plain loop as references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from flwr_pfl.data.types import ArraySplit
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import MODEL_NAMES, RUNNING_STAT_MODELS, EncoderHeadModel, build_model
from flwr_pfl.training.dpsgd import PrivateSteps, RecordLevelDP, StepAccount, check_model, per_record_gradients
from flwr_pfl.training.loops import supervised_loss, train
from flwr_pfl.training.optim import OptimizerConfig

CPU = torch.device("cpu")
LOSS = supervised_loss("classification")


def model(seed: int = 0) -> EncoderHeadModel:
    torch.manual_seed(seed)
    return EncoderHeadModel(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), feature_dim=8, num_outputs=3)


def blobs(n: int = 40, seed: int = 0) -> ArraySplit:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(3, 4, generator=g)[y] * 2 + 0.5 * torch.randn(n, 4, generator=g)
    return ArraySplit(x, y, (torch.arange(n) // 2) % 2)


def steps(n: int, batch: int, z: float = 1.0, clip: float = 1.0, seed: int | None = 5) -> PrivateSteps:
    return PrivateSteps(RecordLevelDP(z, clip, noise_seed=seed), n, batch, seed=0)


def test_per_record_gradients_are_each_records_own_gradient():
    m, data = model(), blobs(6)
    params = list(m.parameters())
    grads, losses = per_record_gradients(m, params, LOSS, data.x, data.y, data.domain)
    for i in range(6):
        m.zero_grad()
        loss = LOSS(m, data.x[i:i + 1], data.y[i:i + 1], data.domain[i:i + 1]).sum()
        loss.backward()
        assert losses[i] == pytest.approx(loss.item(), rel=1e-6)
        for g, p in zip(grads, params):
            torch.testing.assert_close(g[i], p.grad, rtol=1e-5, atol=1e-7)


def test_without_noise_the_step_is_the_sum_of_the_clipped_gradients_over_the_batch_size():
    m, data = model(), blobs(8)
    params = list(m.parameters())
    grads, _ = per_record_gradients(m, params, LOSS, data.x, data.y, data.domain)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
    clip = float(norms.median())  # half the records are clipped
    private = steps(40, 10, z=1e-12, clip=clip)
    noisy, _ = private.gradients(m, params, LOSS, (data.x, data.y, data.domain))
    for got, g in zip(noisy, grads):
        expected = sum(g[i] * min(1.0, clip / float(norms[i])) for i in range(8)) / 10  # B = 10, not the 8 drawn
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)
    assert private.steps == 1


def test_a_records_influence_on_a_step_is_at_most_the_clip_norm_over_the_batch_size():
    m, data = model(), blobs(8)
    params = list(m.parameters())
    without, _ = steps(40, 10, z=1e-12, clip=0.3).gradients(m, params, LOSS, (data.x[1:], data.y[1:], data.domain[1:]))
    huge = data.x.clone()
    huge[0] *= 1e4
    with_it, _ = steps(40, 10, z=1e-12, clip=0.3).gradients(m, params, LOSS, (huge, data.y, data.domain))
    moved = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(with_it, without)))
    assert moved <= 0.3 / 10 + 1e-7


@pytest.mark.parametrize("seed", range(3))
def test_the_noise_has_the_stated_standard_deviation(seed):
    """An empty Poisson batch: the step is noise only, N(0, (z C / B)^2) on 80,000 coordinates."""
    m = nn.Linear(400, 200)
    private = steps(100, 20, z=1.5, clip=0.4, seed=seed)
    noisy, losses = private.gradients(m, list(m.parameters()), LOSS, None)
    values = torch.cat([g.flatten() for g in noisy])
    assert losses is None
    assert float(values.std()) == pytest.approx(1.5 * 0.4 / 20, rel=0.02)
    assert abs(float(values.mean())) < 5 * 1.5 * 0.4 / 20 / math.sqrt(values.numel())


def test_poisson_batches_take_each_record_with_probability_b_over_n():
    data = blobs(50)
    private = steps(50, 10, seed=3)
    sizes, counts = [], torch.zeros(50)
    loader = data.loader(batch_size=10, shuffle=False)
    index_of = {tuple(row.tolist()): i for i, row in enumerate(data.x)}
    for batch in private.batches(loader, epochs=400):
        if batch is None:
            sizes.append(0)
            continue
        x = batch[0]
        sizes.append(len(x))
        for row in x:
            counts[index_of[tuple(row.tolist())]] += 1
    assert len(sizes) == 400 * 5  # ceil(50 / 10) steps per epoch
    q = 0.2
    assert np.mean(sizes) == pytest.approx(50 * q, abs=5 * math.sqrt(50 * q * (1 - q) / len(sizes)))
    assert np.var(sizes) == pytest.approx(50 * q * (1 - q), rel=0.1)
    rates = counts / len(sizes)
    assert float(rates.min()) > q - 5 * math.sqrt(q * (1 - q) / len(sizes))
    assert float(rates.max()) < q + 5 * math.sqrt(q * (1 - q) / len(sizes))


def test_seeded_noise_repeats_and_secret_noise_does_not():
    m = nn.Linear(3, 2)
    a = steps(10, 5, seed=1).gradients(m, list(m.parameters()), LOSS, None)[0]
    b = steps(10, 5, seed=1).gradients(m, list(m.parameters()), LOSS, None)[0]
    c = steps(10, 5, seed=None).gradients(m, list(m.parameters()), LOSS, None)[0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


# ------------------------------------------------------------------------------ accounting
def test_the_accountant_with_every_record_in_every_batch_is_the_plain_gaussians():
    """q = 1 (a batch of every record): no amplification; T steps of multiplier z spend what T
    Gaussian releases spend, as Flower's accountant for client-level DP computes it."""
    from flwr_pfl.strategies.privacy import ClientLevelDP, PrivateAggregator

    account = StepAccount()
    account.add(1.0, 2.0, 7)
    plain = PrivateAggregator(ClientLevelDP(2.0, 1.0, delta=1e-3), 10, 10).planned_epsilon(7, 10)
    # the same mechanism; this accountant's integer orders are a subset of Flower's grid, so its
    # bound is never tighter and within the grid's coarseness (one step more or less moves it 7 %)
    assert plain < account.epsilon(1e-3) <= 1.02 * plain  # strictly: the integer grid, as documented


def test_subsampling_amplifies_and_more_steps_spend_more():
    def eps(rate: float, count: int) -> float:
        account = StepAccount()
        account.add(rate, 1.0, count)
        return account.epsilon(1e-5)

    assert eps(0.01, 100) < eps(0.1, 100) < eps(1.0, 100)
    assert eps(0.01, 100) < eps(0.01, 1000)
    assert StepAccount().epsilon(1e-5) == 0.0
    # Abadi et al.'s moments accountant, Thm. 1: eps = O(q sqrt(T log(1/delta)) / z); at q = 0.01,
    # z = 4, T = 10,000 the paper's own example spends about 1.26 at delta = 1e-5 (Sec. 5.3)
    account = StepAccount()
    account.add(0.01, 4.0, 10_000)
    assert 0.8 < account.epsilon(1e-5) < 1.5


def test_the_account_survives_a_round_trip_through_a_state_record():
    account = StepAccount()
    account.add(0.1, 1.0, 30)
    account.add(0.1, 1.0, 20)
    account.add(0.05, 2.0, 7)
    again = StepAccount.from_scalars(account.to_scalars())
    assert again.steps == {(0.1, 1.0): 50, (0.05, 2.0): 7}
    assert again.epsilon(1e-5) == account.epsilon(1e-5)


# ------------------------------------------------------------------------------ the train loop
def test_with_every_record_in_the_batch_and_no_noise_dp_sgd_is_plain_full_batch_sgd():
    """q = 1, a clipping norm no gradient reaches and noise 1e-12: two epochs of DP-SGD equal
    two full-batch steps of the plain loop, domain weights and a regularizer included."""
    data = blobs(12)
    weights = torch.tensor([1.0, 3.0])
    anchor = [p.detach().clone() for p in model(1).parameters()]

    def regularizer(m):
        return 0.05 * sum((p - a).pow(2).sum() for p, a in zip(m.parameters(), anchor))

    sgd = OptimizerConfig("sgd", learning_rate=0.3)
    plain, private_model = model(), model()
    train(plain, data.loader(batch_size=12, shuffle=False), optimizer=sgd, device=CPU, epochs=2,
          domain_weights=weights, regularizer=regularizer)
    private = steps(12, 12, z=1e-12, clip=1e6)
    stats = train(private_model, data.loader(batch_size=12, shuffle=True), optimizer=sgd, device=CPU, epochs=2,
                  domain_weights=weights, regularizer=regularizer, private=private)
    assert stats.steps == 2 and private.steps == 2
    for a, b in zip(plain.parameters(), private_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_train_loop_takes_ceil_n_over_b_steps_per_epoch_and_respects_max_steps():
    data = blobs(25)
    private = steps(25, 10)
    stats = train(model(), data.loader(batch_size=10, shuffle=True), optimizer=OptimizerConfig("sgd", learning_rate=0.1), device=CPU,
                  epochs=2, private=private)
    assert stats.steps == private.steps == 6
    private = steps(25, 10)
    stats = train(model(), data.loader(batch_size=10, shuffle=True), optimizer=OptimizerConfig("sgd", learning_rate=0.1), device=CPU,
                  epochs=2, max_steps=4, private=private)
    assert stats.steps == private.steps == 4


# ------------------------------------------------------------------------------ refusals
def test_models_with_running_statistics_are_refused():
    with pytest.raises(ConfigError, match="BatchNorm-like modules with running statistics"):
        check_model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), "partition 3")
    check_model(nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2)))
    built = {name: build_model(name, (3, 32, 32) if "resnet" in name or name == "cnn32" else (1, 28, 28), 10)
             for name in MODEL_NAMES if name != "linear"}
    having = {name for name, m in built.items() if any(isinstance(x, nn.modules.batchnorm._NormBase) for x in m.modules())}
    assert having == set(RUNNING_STAT_MODELS)


@pytest.mark.parametrize(("settings", "message"), [
    ({"noise_multiplier": 0.0}, "DP-SGD needs noise > 0"),
    ({"noise_multiplier": 1.0, "clip_norm": 0.0}, "needs a clipping norm > 0"),
    ({"noise_multiplier": 1.0, "delta": 0.0}, r"delta must be in \(0, 1\)"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        RecordLevelDP(**settings)


# ------------------------------------------------------------------------------ details the tool asked about
def test_dropout_draws_a_mask_per_record():
    """Identical records through a dropout layer in train mode get different gradients (each its
    own mask); vmap's default randomness would refuse the dropout outright."""
    torch.manual_seed(0)
    m = EncoderHeadModel(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)), feature_dim=64, num_outputs=3).train()
    x = torch.ones(6, 4)
    grads, _ = per_record_gradients(m, list(m.parameters()), LOSS, x, torch.zeros(6, dtype=torch.long),
                                    torch.zeros(6, dtype=torch.long))
    assert not torch.equal(grads[0][0], grads[0][1])


def test_the_noise_is_the_generators_draw_added_to_the_clipped_sum():
    m, data = model(), blobs(5)
    params = list(m.parameters())
    private = steps(40, 10, z=0.7, clip=0.3, seed=2)
    state = private.generator.get_state()
    noisy, _ = private.gradients(m, params, LOSS, (data.x, data.y, data.domain))
    clean, _ = steps(40, 10, z=1e-300, clip=0.3).gradients(m, params, LOSS, (data.x, data.y, data.domain))
    replay = torch.Generator()
    replay.set_state(state)
    for got, c, p in zip(noisy, clean, params):
        expected = c + 0.7 * 0.3 * torch.randn(p.shape, generator=replay) / 10
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_seeds_give_distinct_repeatable_streams_and_secret_ones_never_repeat():
    firsts = [torch.rand(4, generator=steps(10, 5, seed=s).generator) for s in range(50)]
    assert len({tuple(f.tolist()) for f in firsts}) == 50
    assert torch.equal(torch.rand(4, generator=steps(10, 5, seed=7).generator),
                       torch.rand(4, generator=steps(10, 5, seed=7).generator))
    assert not torch.equal(torch.rand(4, generator=steps(10, 5, seed=None).generator),
                           torch.rand(4, generator=steps(10, 5, seed=None).generator))


def test_poisson_batches_come_from_the_steps_own_generator_and_may_be_empty():
    data = blobs(50)
    loader = data.loader(batch_size=1, shuffle=False)

    def sizes() -> list[int]:
        torch.manual_seed(int(torch.randint(0, 1000, (1,))))  # the global generator moves between runs
        return [0 if b is None else len(b[0]) for b in steps(50, 1, seed=3).batches(loader, epochs=1)]

    first, second = sizes(), sizes()
    assert first == second and 0 in first  # q = 0.02: an empty batch (None) is near certain in 50 steps


def test_a_batch_larger_than_the_data_takes_every_record_and_no_records_is_refused():
    assert steps(5, 10).rate == 1.0
    assert steps(1, 1).rate == 1.0
    with pytest.raises(ConfigError, match="^record-level DP needs at least one training record$"):
        steps(0, 10)


def test_the_messages_name_the_setting_the_modules_and_the_way_out():
    with pytest.raises(ConfigError, match=r"^record-level DP \(DP-SGD\) needs per-record gradients, but the model has "
                       r"BatchNorm-like modules with running statistics \(0, 1, 2, \.\.\.\): a record's output depends on "
                       r"its batch and the statistics would leave unnoised; use a model without them \(mlp, cnn, "
                       r"resnet18-gn\)$"):
        check_model(nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(4)]))
    with pytest.raises(ConfigError, match=r"^node 3: .*running statistics \(0, 1, 2\): "):
        check_model(nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(3)]), "node 3")
    with pytest.raises(ConfigError, match=r"^RecordLevelDP\(noise_multiplier=0.0\) \(run config dp-record-noise-multiplier\): DP-SGD needs noise > 0 \(0 turns "
                       r"record-level DP off\)$"):
        RecordLevelDP(0.0)
    with pytest.raises(ConfigError, match=r"^RecordLevelDP\(delta=1.0\) \(run config dp-record-delta\): delta must be in \(0, 1\) and below 1/n for a client "
                       r"of n records \(0 has no finite epsilon\)$"):
        RecordLevelDP(1.0, delta=1.0)


def test_without_dp_accounting_the_accountant_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    account = StepAccount()
    account.add(0.1, 1.0, 3)
    with pytest.raises(ConfigError, match=r"^record-level DP accounts privacy with dp-accounting, which is not installed "
                       r"\(.+\); pip install \"flwr_pfl\[privacy\]\""):
        account.epsilon(1e-5)


def test_a_record_with_a_vanishing_gradient_adds_nothing():
    """Gradients of norm ~1e-14 are far within the clipping norm: the step is their sum, not a
    division by a norm near zero."""
    m, data = model(), blobs(4)

    def tiny(model_, x, y, d):
        return LOSS(model_, x, y, d) * 1e-14

    noisy, _ = steps(40, 10, z=1e-300, clip=1.0).gradients(m, list(m.parameters()), tiny, (data.x, data.y, data.domain))
    assert math.sqrt(sum(float(g.pow(2).sum()) for g in noisy)) < 1e-13
