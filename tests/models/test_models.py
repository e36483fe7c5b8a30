"""Models: every named model builds, routes samples to their own head and checks its inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flwr_pfl.errors import ConfigError
from flwr_pfl.models import MODEL_NAMES, EncoderHeadModel, build_model

# (input shape, expected feature width, feature_dim argument) per model name
CASES = {
    "mlp": ((1, 6, 6), 200, 0),
    "cnn28": ((1, 28, 28), 128, 0),
    "cnn28-bn": ((1, 28, 28), 128, 0),
    "cnn32": ((3, 32, 32), 128, 0),
    "resnet18": ((3, 32, 32), 512, 0),
    "resnet18-gn": ((3, 32, 32), 512, 0),
    "linear": ((12,), 5, 5),
}


def _batchnorm_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_cases_cover_every_model_name():
    assert set(CASES) == set(MODEL_NAMES)


@pytest.mark.parametrize("num_heads", [1, 3])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_model_output_shapes(name, num_heads):
    torch.manual_seed(0)
    input_shape, feature_width, feature_dim = CASES[name]
    model = build_model(name, input_shape, num_outputs=4, num_heads=num_heads, feature_dim=feature_dim)
    assert isinstance(model, EncoderHeadModel)
    assert model.num_heads == num_heads
    assert model.feature_dim == feature_width
    assert model.num_outputs == 4
    model.eval()
    x = torch.randn(5, *input_shape)
    domain = torch.arange(5) % num_heads
    with torch.no_grad():
        assert model.features(x).shape == (5, feature_width)
        out = model(x, domain)
    assert out.shape == (5, 4)
    assert torch.isfinite(out).all()
    for head in model.heads:
        assert head.in_features == feature_width and head.out_features == 4


def test_single_head_model_ignores_missing_domain():
    torch.manual_seed(0)
    model = build_model("mlp", (7,), num_outputs=2)
    x = torch.randn(4, 7)
    out = model(x)
    assert torch.equal(out, model.heads[0](model.features(x)))
    # with one head, any domain label (even out of range) is ignored
    assert torch.equal(model(x, torch.tensor([0, 5, 2, 1])), out)


def test_custom_feature_dim_for_cnns():
    for name, shape, dim in (("cnn28", (1, 28, 28), 32), ("cnn28-bn", (1, 28, 28), 24), ("cnn32", (3, 32, 32), 48)):
        model = build_model(name, shape, 10, feature_dim=dim).eval()
        assert model.feature_dim == dim and model.heads[0].in_features == dim
        with torch.no_grad():
            assert model.features(torch.randn(2, *shape)).shape == (2, dim)


@pytest.mark.parametrize("name", ["mlp", "cnn28", "linear", "resnet18-gn"])
def test_routing_picks_each_samples_own_head(name):
    torch.manual_seed(1)
    input_shape, _, feature_dim = CASES[name]
    num_heads = 4
    model = build_model(name, input_shape, num_outputs=3, num_heads=num_heads, feature_dim=feature_dim)
    model.eval()
    x = torch.randn(9, *input_shape)
    domain = torch.tensor([3, 0, 1, 1, 2, 3, 0, 2, 3])
    with torch.no_grad():
        out = model(x, domain)
        features = model.features(x)
        # heads really differ, so a wrong routing would show
        per_head = [head(features) for head in model.heads]
        assert not torch.allclose(per_head[0], per_head[1])
        for i in range(len(x)):
            expected = model.heads[int(domain[i])](features[i : i + 1])[0]
            torch.testing.assert_close(out[i], expected)
            assert torch.allclose(out[i], per_head[int(domain[i])][i])


def test_routing_gradients_reach_only_used_heads():
    torch.manual_seed(2)
    model = build_model("mlp", (5,), num_outputs=2, num_heads=3)
    x = torch.randn(6, 5)
    model(x, torch.tensor([0, 2, 0, 2, 2, 0])).sum().backward()
    assert model.heads[0].weight.grad.abs().sum() > 0
    assert model.heads[2].weight.grad.abs().sum() > 0
    assert model.heads[1].weight.grad is None or model.heads[1].weight.grad.abs().sum() == 0


@pytest.mark.parametrize("bad", [[0, 3], [-1, 0], [0, 7]])
def test_domain_label_outside_range_raises(bad):
    model = build_model("mlp", (5,), num_outputs=2, num_heads=3)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        model(torch.randn(2, 5), torch.tensor(bad))


def test_multi_head_model_without_domains_raises():
    model = build_model("mlp", (5,), num_outputs=2, num_heads=2)
    with pytest.raises(ValueError, match="domain"):
        model(torch.randn(2, 5))


def test_cnn28_rejects_32x32_input():
    with pytest.raises(ConfigError, match="cnn28"):
        build_model("cnn28", (3, 32, 32), num_outputs=10)


def test_cnn28_bn_is_cnn28_with_a_batchnorm_before_each_relu():
    plain = build_model("cnn28", (1, 28, 28), num_outputs=10, feature_dim=24)
    bn = build_model("cnn28-bn", (1, 28, 28), num_outputs=10, feature_dim=24)
    assert _batchnorm_layers(plain) == []
    kinds = [type(m) for m in bn.encoder]
    relus = [i for i, k in enumerate(kinds) if k is nn.ReLU]
    assert [kinds[i - 1] for i in relus] == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]
    assert [m.num_features for m in _batchnorm_layers(bn)] == [16, 32, 24]
    # the same weights otherwise: cnn28's parameters plus the norms' (weight and bias each)
    extra = sum(p.numel() for m in _batchnorm_layers(bn) for p in m.parameters())
    assert sum(p.numel() for p in bn.parameters()) == sum(p.numel() for p in plain.parameters()) + extra == (
        sum(p.numel() for p in plain.parameters()) + 2 * (16 + 32 + 24))
    with pytest.raises(ConfigError, match="'cnn28-bn' needs 28x28 inputs"):
        build_model("cnn28-bn", (3, 32, 32), num_outputs=10)


def test_cnn32_rejects_28x28_input():
    with pytest.raises(ConfigError, match="cnn32"):
        build_model("cnn32", (1, 28, 28), num_outputs=10)


def test_unknown_model_name_raises_with_allowed_names():
    with pytest.raises(ConfigError, match="allowed") as info:
        build_model("vgg", (3, 32, 32), num_outputs=10)
    for name in MODEL_NAMES:
        assert name in str(info.value)


def test_linear_model_needs_feature_dim():
    with pytest.raises(ConfigError, match="feature-dim"):
        build_model("linear", (10,), num_outputs=1)


def test_zero_heads_raises():
    with pytest.raises(ValueError, match="num_heads"):
        EncoderHeadModel(nn.Flatten(), 4, 2, num_heads=0)


def test_resnet18_gn_has_no_batchnorm_and_resnet18_has():
    gn = build_model("resnet18-gn", (3, 32, 32), num_outputs=10)
    bn = build_model("resnet18", (3, 32, 32), num_outputs=10)
    assert _batchnorm_layers(gn) == []
    assert any(isinstance(m, nn.GroupNorm) for m in gn.modules())
    assert len(_batchnorm_layers(bn)) > 0
    assert not any(isinstance(m, nn.GroupNorm) for m in bn.modules())
    # BatchNorm statistics are buffers that travel in the state_dict; GroupNorm has none
    assert any(k.endswith("running_mean") for k in bn.state_dict())
    assert not any(k.endswith("running_mean") for k in gn.state_dict())


def test_resnet18_with_one_channel_input():
    torch.manual_seed(0)
    model = build_model("resnet18-gn", (1, 28, 28), num_outputs=10, num_heads=2)
    assert model.encoder.conv1.in_channels == 1
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, 28, 28), torch.tensor([0, 1]))
    assert out.shape == (2, 10)


def test_resnet18_builds_in_train_mode():
    model = build_model("resnet18", (3, 32, 32), num_outputs=10)
    assert all(m.training for m in model.modules())  # every BatchNorm too, not only the top modules


def test_linear_model_has_no_head_bias_and_computes_BTx():
    torch.manual_seed(3)
    d, k = 12, 5
    model = build_model("linear", (d,), num_outputs=1, num_heads=3, feature_dim=k)
    for head in model.heads:
        assert head.bias is None
    encoder_params = dict(model.encoder.named_parameters())
    assert list(encoder_params) == ["linear.weight"]
    B = model.encoder.linear.weight.detach().T  # (d, k)
    assert B.shape == (d, k)
    x = torch.randn(7, d)
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), x @ B)
        domain = torch.tensor([0, 1, 2, 0, 1, 2, 0])
        out = model(x, domain)
        for i in range(7):
            w = model.heads[int(domain[i])].weight[0]  # (k,)
            torch.testing.assert_close(out[i, 0], (x[i] @ B) @ w)
    # homogeneous: no bias anywhere
    with torch.no_grad():
        assert torch.equal(model(torch.zeros(2, d), torch.tensor([0, 1])), torch.zeros(2, 1))
    # other models do have head biases
    assert build_model("mlp", (4,), 2).heads[0].bias is not None


def test_linear_model_flattens_multidimensional_input():
    model = build_model("linear", (2, 3), num_outputs=2, feature_dim=4)
    x = torch.randn(3, 2, 3)
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), x.flatten(1) @ model.encoder.linear.weight.T)
