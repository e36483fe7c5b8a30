"""The shared train and evaluation loops, and optimizers from config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.data.types import ArraySplit
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import EncoderHeadModel, build_model
from flwr_pfl.training.loops import (
    EvalResult,
    evaluate,
    per_sample_loss,
    supervised_loss,
    train,
)
from flwr_pfl.training.optim import OptimizerConfig, make_optimizer

CPU = torch.device("cpu")
SGD = OptimizerConfig("sgd", learning_rate=0.1)


def _model(seed: int = 0, num_heads: int = 2, in_dim: int = 4, num_outputs: int = 2) -> EncoderHeadModel:
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(in_dim, 8), nn.Tanh())
    return EncoderHeadModel(encoder, feature_dim=8, num_outputs=num_outputs, num_heads=num_heads)


def _blobs(n: int = 64, seed: int = 0, num_domains: int = 2) -> ArraySplit:
    """Two linearly separable classes in 4-D, samples spread over domains."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    centers = torch.tensor([[2.0, 2.0, 0.0, 0.0], [-2.0, -2.0, 0.0, 0.0]])
    x = centers[y] + 0.3 * torch.randn(n, 4, generator=g)
    domain = (torch.arange(n) // 2) % num_domains
    return ArraySplit(x, y, domain)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_batch(split: ArraySplit) -> DataLoader:
    return split.loader(batch_size=len(split), shuffle=False)


# ---------------------------------------------------------------- train


def test_train_lowers_loss_on_separable_problem():
    split = _blobs()
    model = _model()
    before = evaluate(model, split, device=CPU, num_domains=2)
    stats = train(model, split.loader(16, shuffle=True, seed=0), optimizer=SGD, device=CPU, epochs=10)
    after = evaluate(model, split, device=CPU, num_domains=2)
    # data, model and loader seeds 0-7: loss after / before 0.056..0.108, accuracy 1.0
    assert after.loss < 0.5 * before.loss
    assert after.accuracy == 1.0
    assert stats.steps == 10 * 4
    assert stats.num_examples == 64
    assert math.isfinite(stats.loss) and stats.loss > 0
    assert stats.seconds >= 0


def test_train_accepts_plain_pairs_loader():
    split = _blobs()
    model = _model(num_heads=1)
    loader = DataLoader(TensorDataset(split.x, split.y), batch_size=16)
    before = evaluate(model, loader, device=CPU).loss
    train(model, loader, optimizer=SGD, device=CPU, epochs=5)
    assert evaluate(model, loader, device=CPU).loss < before  # seeds 0-7: after / before 0.074..0.114


def test_train_stats_loss_is_mean_step_loss_before_update():
    split = _blobs()
    model = _model()
    with torch.no_grad():
        expected = F.cross_entropy(model(split.x, split.domain), split.y).item()
    stats = train(model, _full_batch(split), optimizer=SGD, device=CPU, max_steps=1)
    assert stats.steps == 1
    assert stats.loss == pytest.approx(expected, rel=1e-6)


def test_train_loss_is_the_mean_of_the_step_losses_over_every_epoch_with_an_unequal_last_batch():
    """TrainStats.loss (a client's ``train_loss``) averages the steps' mean losses: batches of 4,
    4 and 2 samples whose per-sample losses are 0 .. 9 have step losses 1.5, 5.5 and 8.5, so the
    figure is 31/6 over two epochs, not the per-sample mean 4.5, nor the last step's 8.5; a
    stop after 4 steps averages those 4 (the next epoch's first batch included)."""
    x = torch.zeros(10, 4)
    x[:, 0] = torch.arange(10.0)
    split = ArraySplit(x, torch.arange(10) % 2, torch.zeros(10, dtype=torch.long))

    def first_feature(m, x, y, d):  # a per-sample loss that the parameters do not change
        return x[:, 0] + 0.0 * m(x, d).sum(1)

    loader = split.loader(4, shuffle=False)
    stats = train(_model(num_heads=1), loader, optimizer=SGD, device=CPU, epochs=2, loss_fn=first_feature)
    assert (stats.steps, stats.num_examples) == (6, 10)
    assert stats.loss == pytest.approx((1.5 + 5.5 + 8.5) / 3, rel=1e-6)
    stopped = train(_model(num_heads=1), loader, optimizer=SGD, device=CPU, epochs=2, loss_fn=first_feature, max_steps=4)
    assert stopped.steps == 4 and stopped.loss == pytest.approx((1.5 + 5.5 + 8.5 + 1.5) / 4, rel=1e-6)


def test_train_matches_manual_sgd_step():
    split = _blobs()
    model, reference = _model(), _model()
    train(model, _full_batch(split), optimizer=SGD, device=CPU)
    loss = F.cross_entropy(reference(split.x, split.domain), split.y)
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    with torch.no_grad():
        for (name, p), g in zip(reference.named_parameters(), grads):
            torch.testing.assert_close(dict(model.named_parameters())[name], p - 0.1 * g)


def test_clip_grad_norm_scales_a_longer_step_gradient_to_the_norm_and_leaves_a_shorter_one():
    split = _blobs()
    reference = _model()
    loss = F.cross_entropy(reference(split.x, split.domain), split.y)
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    for clip, factor in ((norm / 4, 0.25), (norm * 2, 1.0)):
        model = _model()
        train(model, _full_batch(split), optimizer=SGD, device=CPU, clip_grad_norm=clip)
        with torch.no_grad():
            for (name, p), g in zip(reference.named_parameters(), grads):
                torch.testing.assert_close(dict(model.named_parameters())[name], p - 0.1 * factor * g, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="clip_grad_norm must be >= 0"):
        train(_model(), _full_batch(split), optimizer=SGD, device=CPU, clip_grad_norm=-1.0)


@pytest.mark.parametrize(
    "groups, trained",
    [
        (("heads",), ("heads.",)),
        (("body",), ("encoder.",)),
        (("head:1",), ("heads.1.",)),
        (("body", "head:0"), ("encoder.", "heads.0.")),
    ],
)
def test_train_only_changes_asked_groups(groups, trained):
    split = _blobs()
    model = _model()
    before = _params(model)
    train(model, split.loader(16, shuffle=False), optimizer=SGD, device=CPU, epochs=2, groups=groups)
    after = _params(model)
    for key in before:
        if key.startswith(trained):
            assert not torch.equal(before[key], after[key]), key
        else:
            assert torch.equal(before[key], after[key]), key
    assert all(p.requires_grad for p in model.parameters())


def test_train_with_momentum_and_weight_decay_still_respects_groups():
    split = _blobs()
    model = _model()
    before = _params(model)
    opt = OptimizerConfig("sgd", learning_rate=0.1, momentum=0.9, weight_decay=0.1)
    train(model, _full_batch(split), optimizer=opt, device=CPU, epochs=3, groups=("head:0",))
    after = _params(model)
    for key in before:
        assert torch.equal(before[key], after[key]) != key.startswith("heads.0."), key


def test_zero_domain_weight_equals_training_on_other_domain_alone():
    split = _blobs(n=40)
    other = split.subset(split.domain == 1)
    n, n_other = len(split), len(other)
    # The step loss is the mean over all samples, so scaling domain 1 by n / n_other makes
    # the weighted loss equal the plain mean over domain 1's samples.
    weights = torch.tensor([0.0, n / n_other])
    weighted, alone = _model(5), _model(5)
    torch.manual_seed(11)
    train(weighted, _full_batch(split), optimizer=SGD, device=CPU, epochs=5, domain_weights=weights)
    torch.manual_seed(11)
    train(alone, _full_batch(other), optimizer=SGD, device=CPU, epochs=5)
    w, a = _params(weighted), _params(alone)
    for key in w:
        torch.testing.assert_close(w[key], a[key], rtol=1e-5, atol=1e-6)
    # and the head of the zero-weighted domain did not move at all
    assert torch.equal(w["heads.0.weight"], _params(_model(5))["heads.0.weight"])


def test_domain_weights_scale_each_samples_loss():
    split = _blobs(n=16)
    weights = torch.tensor([0.5, 3.0])
    model, reference = _model(), _model()
    stats = train(model, _full_batch(split), optimizer=SGD, device=CPU, domain_weights=weights)
    losses = F.cross_entropy(reference(split.x, split.domain), split.y, reduction="none")
    loss = (losses * weights[split.domain]).mean()
    assert stats.loss == pytest.approx(loss.item(), rel=1e-6)
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    with torch.no_grad():
        for (name, p), g in zip(reference.named_parameters(), grads):
            torch.testing.assert_close(dict(model.named_parameters())[name], p - 0.1 * g)


def test_regularizer_is_added_to_the_step_loss():
    split = _blobs(n=8)
    model = _model()
    before = _params(model)

    def zero_loss(m, x, y, d):
        return 0.0 * m(x, d).sum(1)

    def half_sq_norm(m):
        return 0.5 * sum((p**2).sum() for p in m.parameters())

    stats = train(
        model, _full_batch(split), optimizer=SGD, device=CPU, loss_fn=zero_loss, regularizer=half_sq_norm
    )
    # gradient of 0.5 ||w||^2 is w: one SGD step scales every parameter by (1 - lr)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), 0.9 * before[name])
    assert stats.loss == 0.0  # reported loss excludes the regularizer


def test_regularizer_changes_the_result():
    split = _blobs()
    plain, regularized = _model(), _model()
    train(plain, _full_batch(split), optimizer=SGD, device=CPU, epochs=3)

    def pull_heads_to_zero(m):
        return 2.0 * sum((p**2).sum() for p in m.heads.parameters())

    train(regularized, _full_batch(split), optimizer=SGD, device=CPU, epochs=3, regularizer=pull_heads_to_zero)
    norm = lambda m: sum(float((p.detach() ** 2).sum()) for p in m.heads.parameters())  # noqa: E731
    assert norm(regularized) < 0.5 * norm(plain)


def test_max_steps_stops_early():
    split = _blobs()
    loader = split.loader(8, shuffle=False)  # 8 batches per epoch
    assert train(_model(), loader, optimizer=SGD, device=CPU, epochs=5, max_steps=11).steps == 11
    assert train(_model(), loader, optimizer=SGD, device=CPU, epochs=5, max_steps=3).steps == 3
    assert train(_model(), loader, optimizer=SGD, device=CPU, epochs=2, max_steps=100).steps == 16
    assert train(_model(), loader, optimizer=SGD, device=CPU, epochs=2).steps == 16


def test_max_steps_equals_that_many_manual_steps():
    split = _blobs()
    loader = split.loader(8, shuffle=False)
    stopped, reference = _model(), _model()
    train(stopped, loader, optimizer=SGD, device=CPU, epochs=3, max_steps=10)
    train(reference, loader, optimizer=SGD, device=CPU, epochs=1)
    train(reference, loader, optimizer=SGD, device=CPU, epochs=1, max_steps=2)
    a, b = _params(stopped), _params(reference)
    for key in a:
        torch.testing.assert_close(a[key], b[key])


def test_zero_epochs_changes_nothing_and_negative_raises():
    split = _blobs()
    model = _model()
    before = _params(model)
    stats = train(model, _full_batch(split), optimizer=SGD, device=CPU, epochs=0)
    assert stats.steps == 0 and stats.loss == 0.0
    assert all(torch.equal(before[k], v) for k, v in _params(model).items())
    with pytest.raises(ValueError, match="epochs"):
        train(model, _full_batch(split), optimizer=SGD, device=CPU, epochs=-1)


def test_nan_input_raises_floating_point_error_before_any_update():
    split = _blobs(n=8)
    x = split.x.clone()
    x[3, 1] = float("nan")
    model = _model()
    before = _params(model)
    loader = ArraySplit(x, split.y, split.domain).loader(8, shuffle=False)
    with pytest.raises(FloatingPointError, match="step 1"):
        train(model, loader, optimizer=SGD, device=CPU)
    assert all(torch.equal(before[k], v) for k, v in _params(model).items())
    assert all(p.requires_grad for p in model.parameters())


def test_huge_learning_rate_raises_floating_point_error():
    torch.manual_seed(0)
    x = torch.randn(32, 6)
    y = x @ torch.randn(6) * 100.0
    split = ArraySplit(x, y, torch.zeros(32, dtype=torch.long))
    model = build_model("linear", (6,), num_outputs=1, feature_dim=3)
    with pytest.raises(FloatingPointError, match="learning rate"):
        train(
            model,
            split.loader(8, shuffle=False),
            optimizer=OptimizerConfig("sgd", learning_rate=1e6),
            device=CPU,
            epochs=50,
            task="regression",
        )


def test_nan_inputs_error_names_the_data_the_batch_and_the_client_not_the_learning_rate():
    split = _blobs(n=8)
    x = split.x.clone()
    x[5, 0], x[5, 2], x[6, 1] = float("nan"), float("inf"), float("nan")  # batch 2 of 2
    loader = ArraySplit(x, split.y, split.domain).loader(4, shuffle=False)
    with pytest.raises(FloatingPointError) as err:
        train(_model(), loader, optimizer=SGD, device=CPU, who="partition 3")
    message = str(err.value)
    assert message.startswith("partition 3: ")
    assert "non-finite values" in message and "inputs hold 3 NaN/Inf value(s) in 2 of 4 samples" in message
    assert "step 2 (epoch 1, batch 2)" in message and "targets" not in message
    assert "will not help" in message and "lower the learning rate" not in message


def test_nan_regression_targets_are_named_as_the_targets():
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8)
    y[1] = float("nan")
    split = ArraySplit(x, y, torch.zeros(8, dtype=torch.long))
    model = build_model("linear", (6,), num_outputs=1, feature_dim=3)
    with pytest.raises(FloatingPointError, match=r"targets hold 1 NaN/Inf value\(s\) in 1 of 8 samples") as err:
        train(model, split.loader(8, shuffle=False), optimizer=SGD, device=CPU, task="regression")
    assert "inputs" not in str(err.value) and "non-finite values at step 1" in str(err.value)


def test_divergence_on_finite_data_says_so_and_advises_a_lower_learning_rate():
    torch.manual_seed(0)
    x = torch.randn(32, 6)
    split = ArraySplit(x, x @ torch.randn(6) * 100.0, torch.zeros(32, dtype=torch.long))
    model = build_model("linear", (6,), num_outputs=1, feature_dim=3)
    with pytest.raises(FloatingPointError, match=r"on finite data: training diverged; lower the learning rate \(now 1000000.0\)"):
        train(model, split.loader(8, shuffle=False), optimizer=OptimizerConfig("sgd", learning_rate=1e6),
              device=CPU, epochs=50, task="regression", who="partition 0")


def test_client_names_its_partition_when_its_data_has_nan() -> None:
    from flwr.app import Context, RecordDict

    from flwr_pfl.clients.base import LocalData, PFLClient, TrainConfig

    split = _blobs(n=8)
    x = split.x.clone()
    x[0, 0] = float("nan")
    data = LocalData(train=ArraySplit(x, split.y, split.domain).loader(8, shuffle=False), test=_full_batch(split))
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 4}, state=RecordDict(), run_config={})
    client = PFLClient(context, _model(), data, TrainConfig(device="cpu"))
    with pytest.raises(FloatingPointError, match=r"^partition 4: the training data has non-finite values"):
        client.fit(client.get_parameters({}), {})


def test_non_finite_regularizer_raises():
    split = _blobs(n=8)
    model = _model()
    before = _params(model)
    with pytest.raises(FloatingPointError, match=r"training loss became inf at step 1 \(epoch 1, batch 1\) on finite data"):
        train(
            model, _full_batch(split), optimizer=SGD, device=CPU,
            regularizer=lambda m: torch.tensor(float("inf")),
        )
    assert all(torch.equal(before[k], v) for k, v in _params(model).items())  # no step was taken


def test_train_regression_lowers_mse():
    torch.manual_seed(0)
    x = torch.randn(64, 5)
    y = x @ torch.randn(5, 2)
    split = ArraySplit(x, y, torch.zeros(64, dtype=torch.long))
    model = _model(in_dim=5, num_heads=1, num_outputs=2)
    before = evaluate(model, split, device=CPU, task="regression").loss
    train(model, split.loader(16, shuffle=False), optimizer=SGD, device=CPU, epochs=20, task="regression")
    # seeds 0-7 (data and model): MSE after / before 0.011..0.025
    assert evaluate(model, split, device=CPU, task="regression").loss < 0.5 * before


# ---------------------------------------------------------------- losses


def test_per_sample_loss_classification_and_regression():
    out = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    expected = torch.stack([-torch.log_softmax(out[i], 0)[y[i]] for i in range(3)])
    torch.testing.assert_close(per_sample_loss(out, y, "classification"), expected)
    targets = torch.tensor([[1.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    torch.testing.assert_close(
        per_sample_loss(out, targets, "regression"), torch.tensor([0.5, 2.0, 0.0])
    )
    # (N,) regression targets for a single output
    torch.testing.assert_close(
        per_sample_loss(torch.tensor([[1.0], [2.0]]), torch.tensor([0.0, 4.0]), "regression"),
        torch.tensor([1.0, 4.0]),
    )


# ---------------------------------------------------------------- evaluate


def _eval_data(n: int = 23, num_domains: int = 3) -> ArraySplit:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    domain = torch.tensor([i % num_domains for i in range(n)])
    domain[0] = 2  # unequal counts
    return ArraySplit(x, y, domain)


def test_evaluate_matches_hand_computation_per_domain():
    data = _eval_data()
    model = _model(num_heads=3, num_outputs=3)
    result = evaluate(model, data, device=CPU, num_domains=3, batch_size=5)
    with torch.no_grad():
        out = model(data.x, data.domain)
    losses = F.cross_entropy(out, data.y, reduction="none")
    hits = out.argmax(1) == data.y
    assert result.num_examples == 23
    assert result.loss == pytest.approx(losses.mean().item(), rel=1e-6)
    assert result.accuracy == pytest.approx(hits.float().mean().item())
    for m in range(3):
        mask = data.domain == m
        assert result.per_domain_count[m] == int(mask.sum())
        assert result.per_domain_correct[m] == int(hits[mask].sum())
        assert result.per_domain_loss[m] == pytest.approx(losses[mask].sum().item(), rel=1e-6)
    assert sum(result.per_domain_count) == 23
    metrics = result.metrics()
    assert set(metrics) == {"loss", "accuracy"} | {f"{k}_d{m}" for k in ("n", "acc", "loss") for m in range(3)}
    for m in range(3):
        mask = data.domain == m
        assert metrics[f"n_d{m}"] == float(mask.sum())
        assert metrics[f"acc_d{m}"] == pytest.approx(hits[mask].float().mean().item())
        assert metrics[f"loss_d{m}"] == pytest.approx(losses[mask].mean().item(), rel=1e-6)
    assert not model.training


def test_evaluate_accepts_dataloader_of_pairs():
    data = _eval_data()
    model = _model(num_heads=1, num_outputs=3)
    loader = DataLoader(TensorDataset(data.x, data.y), batch_size=4)
    result = evaluate(model, loader, device=CPU)
    with torch.no_grad():
        out = model(data.x)
    assert result.loss == pytest.approx(F.cross_entropy(out, data.y).item(), rel=1e-6)
    assert result.accuracy == pytest.approx((out.argmax(1) == data.y).float().mean().item())
    assert result.per_domain_count == [23]
    # one domain: no per-domain keys
    assert set(result.metrics()) == {"loss", "accuracy"}


def test_evaluate_regression_uses_mean_squared_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=g)
    y = torch.randn(10, 2, generator=g)
    split = ArraySplit(x, y, torch.tensor([0, 1] * 5))
    model = _model(num_heads=2, num_outputs=2)
    result = evaluate(model, split, device=CPU, task="regression", num_domains=2, batch_size=3)
    with torch.no_grad():
        out = model(x, split.domain)
    assert result.loss == pytest.approx(((out - y) ** 2).mean().item(), rel=1e-6)
    assert result.accuracy is None
    metrics = result.metrics()
    assert "accuracy" not in metrics and not any(k.startswith("acc_") for k in metrics)
    d1 = split.domain == 1
    assert metrics["loss_d1"] == pytest.approx(((out[d1] - y[d1]) ** 2).mean().item(), rel=1e-6)
    assert metrics["n_d1"] == 5.0


def test_evaluate_uses_custom_predict_and_loss():
    data = _eval_data()
    model = _model(num_heads=3, num_outputs=3)
    # predict the label itself: accuracy 1; loss: constant 2 per sample
    fixed = lambda m, x, d: F.one_hot(data.y, 3).float()  # noqa: E731
    result = evaluate(
        model, data, device=CPU, num_domains=3, batch_size=len(data),
        predict_fn=fixed, loss_fn=lambda m, x, y, d: torch.full((len(x),), 2.0),
    )
    assert result.accuracy == 1.0 and result.loss == pytest.approx(2.0)


def test_eval_result_metrics_prefix_extra_and_empty_domains():
    result = EvalResult(
        loss=0.5, num_examples=6, accuracy=0.5,
        per_domain_count=[2, 0, 4], per_domain_loss=[1.0, 0.0, 2.0], per_domain_correct=[1, 0, 2],
        extra={"global_accuracy": 0.25},
    )
    assert result.metrics("test_") == {
        "test_loss": 0.5, "test_accuracy": 0.5,
        "test_n_d0": 2.0, "test_loss_d0": 0.5, "test_acc_d0": 0.5,
        "test_n_d2": 4.0, "test_loss_d2": 0.5, "test_acc_d2": 0.5,
        "global_accuracy": 0.25,
    }


def test_evaluate_empty_loader():
    empty = ArraySplit(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    result = evaluate(_model(), empty, device=CPU, num_domains=2)
    assert result.num_examples == 0 and result.loss == 0.0 and result.accuracy == 0.0


def test_supervised_loss_uses_own_head():
    data = _eval_data()
    model = _model(num_heads=3, num_outputs=3)
    losses = supervised_loss("classification")(model, data.x, data.y, data.domain)
    with torch.no_grad():
        for i in [0, 5, 9]:
            out = model.heads[int(data.domain[i])](model.features(data.x[i : i + 1]))
            assert losses[i].item() == pytest.approx(F.cross_entropy(out, data.y[i : i + 1]).item(), rel=1e-6)


# ---------------------------------------------------------------- optimizers


def test_optimizer_config_validation():
    with pytest.raises(ConfigError, match="optimizer='rmsprp' is unknown .did you mean rmsprop"):
        OptimizerConfig("rmsprp")
    for lr in [0.0, -1.0, float("nan")]:
        with pytest.raises(ConfigError, match="learning-rate"):
            OptimizerConfig(learning_rate=lr)
    for momentum in [-0.1, 1.0]:
        with pytest.raises(ConfigError, match="momentum"):
            OptimizerConfig(momentum=momentum)
    with pytest.raises(ConfigError, match="weight-decay"):
        OptimizerConfig(weight_decay=-1e-4)


def test_optimizer_config_scaled():
    config = OptimizerConfig("sgd", 0.1, 0.9, 1e-4)
    scaled = config.scaled(0.5)
    assert scaled == OptimizerConfig("sgd", 0.05, 0.9, 1e-4)
    assert config.learning_rate == 0.1


def test_make_optimizer():
    params = [nn.Parameter(torch.zeros(2))]
    sgd = make_optimizer(params, OptimizerConfig("sgd", 0.2, 0.5, 0.01))
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.param_groups[0]["lr"] == 0.2
    assert sgd.param_groups[0]["momentum"] == 0.5
    assert sgd.param_groups[0]["weight_decay"] == 0.01
    adam = make_optimizer(iter(params), OptimizerConfig("adam", 0.003, weight_decay=0.1))
    assert isinstance(adam, torch.optim.Adam)
    assert adam.param_groups[0]["lr"] == 0.003 and adam.param_groups[0]["weight_decay"] == 0.1
    assert adam.param_groups[0]["params"][0] is params[0]


def test_after_step_sees_every_step_and_collect_features_matches_the_encoder():
    from flwr_pfl.data.types import ArraySplit
    from flwr_pfl.models import build_model
    from flwr_pfl.training import OptimizerConfig, collect_features, train

    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3)
    split = ArraySplit(torch.randn(40, 4), torch.randint(0, 3, (40,)), torch.zeros(40, dtype=torch.long))
    steps: list[int] = []
    train(model, split.loader(8, shuffle=False), optimizer=OptimizerConfig(learning_rate=0.1),
          device=torch.device("cpu"), epochs=2, after_step=lambda m, k: steps.append(k))
    assert steps == list(range(1, 11))
    z, y, d = collect_features(model, split, device=torch.device("cpu"), batch_size=7)
    assert torch.allclose(z, model.eval().features(split.x), atol=1e-6) and torch.equal(y, split.y) and torch.equal(d, split.domain)


def test_collect_features_computes_them_in_eval_mode():
    """A model left in train mode (as training leaves it) with dropout in its encoder: the
    features are the eval-mode ones (no unit dropped, the same on every call), and the model is
    left in eval mode."""
    from flwr_pfl.training import collect_features

    torch.manual_seed(0)
    model = EncoderHeadModel(nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Tanh()), feature_dim=16, num_outputs=2)
    split = _blobs(n=20)
    with torch.no_grad():
        want = model.eval().features(split.x)
    model.train()
    z, _, _ = collect_features(model, split, device=CPU, batch_size=8)
    assert not model.training and not model.encoder[1].training
    torch.testing.assert_close(z, want, rtol=0, atol=1e-6)
