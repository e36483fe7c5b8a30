"""Parameter groups <-> ordered NumPy arrays, and freezing groups for training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flwr_pfl.models import EncoderHeadModel, build_model
from flwr_pfl.training.params import (
    get_arrays,
    group_keys,
    group_parameters,
    group_shapes,
    only_trainable,
    set_arrays,
)

GROUPS = ["all", "body", "heads", "head:0", "head:1", "head:2"]


def _model(seed: int) -> EncoderHeadModel:
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5))
    return EncoderHeadModel(encoder, feature_dim=5, num_outputs=3, num_heads=3)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _prefix(group: str) -> str:
    return {"all": "", "body": "encoder.", "heads": "heads."}.get(group, f"heads.{group[5:]}.")


def test_group_keys_follow_state_dict_order():
    model = _model(0)
    all_keys = list(model.state_dict())
    assert group_keys(model, "all") == all_keys
    assert group_keys(model, "body") == [k for k in all_keys if k.startswith("encoder.")]
    assert group_keys(model, "heads") == [
        "heads.0.weight", "heads.0.bias", "heads.1.weight", "heads.1.bias", "heads.2.weight", "heads.2.bias"
    ]
    assert group_keys(model, "head:1") == ["heads.1.weight", "heads.1.bias"]
    # buffers are part of the wire layout
    assert "encoder.1.running_mean" in group_keys(model, "body")
    assert "encoder.1.num_batches_tracked" in group_keys(model, "body")


def test_head_group_does_not_match_longer_index():
    torch.manual_seed(0)
    model = EncoderHeadModel(nn.Flatten(), feature_dim=3, num_outputs=2, num_heads=12)
    assert group_keys(model, "head:1") == ["heads.1.weight", "heads.1.bias"]
    assert group_keys(model, "head:11") == ["heads.11.weight", "heads.11.bias"]
    assert len(group_keys(model, "heads")) == 24


@pytest.mark.parametrize("group", GROUPS)
def test_get_arrays_is_state_dict_in_wire_order(group):
    model = _model(0)
    state = model.state_dict()
    keys = group_keys(model, group)
    arrays = get_arrays(model, group)
    assert len(arrays) == len(keys)
    for key, array in zip(keys, arrays):
        assert isinstance(array, np.ndarray)
        np.testing.assert_array_equal(array, state[key].numpy())
        assert array.dtype == state[key].numpy().dtype
    assert group_shapes(model, group) == [tuple(state[k].shape) for k in keys]


def test_get_arrays_returns_copies():
    model = _model(0)
    arrays = get_arrays(model, "heads")
    before = model.heads[0].weight.detach().clone()
    arrays[0][...] = 123.0
    assert torch.equal(model.heads[0].weight.detach(), before)


@pytest.mark.parametrize("group", GROUPS)
def test_set_arrays_round_trip_per_group(group):
    source, target = _model(1), _model(2)
    # distinguishable buffers too
    with torch.no_grad():
        source.encoder[1].running_mean.fill_(0.7)
        source.encoder[1].num_batches_tracked.fill_(9)
    before = _state(target)
    set_arrays(target, get_arrays(source, group), group)
    after = _state(target)
    src = _state(source)
    prefix = _prefix(group)
    changed = 0
    for key in after:
        if key.startswith(prefix):
            assert torch.equal(after[key], src[key]), key
            changed += 0 if torch.equal(before[key], src[key]) else 1
        else:
            assert torch.equal(after[key], before[key]), key
    assert changed > 0
    # and back again
    for a, b in zip(get_arrays(target, group), get_arrays(source, group)):
        np.testing.assert_array_equal(a, b)


def test_set_arrays_keeps_dtypes_and_accepts_other_float_dtypes():
    model = _model(0)
    arrays = [a.astype(np.float64) if a.dtype == np.float32 else a for a in get_arrays(model)]
    arrays[0] = arrays[0] + 1.0
    set_arrays(model, arrays)
    assert model.encoder[0].weight.dtype == torch.float32
    assert model.encoder[1].num_batches_tracked.dtype == torch.long
    np.testing.assert_allclose(model.encoder[0].weight.detach().numpy(), arrays[0], rtol=1e-6)


def test_set_arrays_count_mismatch_names_group_and_counts():
    model = _model(0)
    arrays = get_arrays(model, "heads")
    with pytest.raises(ValueError, match=r"'heads'.*6 tensors but 5 arrays"):
        set_arrays(model, arrays[:-1], "heads")
    with pytest.raises(ValueError, match=r"'head:2'.*2 tensors but 3 arrays"):
        set_arrays(model, arrays[:3], "head:2")


def test_set_arrays_shape_mismatch_names_key_and_changes_nothing():
    model = _model(0)
    before = _state(model)
    arrays = [a + 1 for a in get_arrays(model, "all")]
    keys = group_keys(model, "all")
    bad = len(arrays) - 1  # the last one: earlier arrays would be copied by a careless loader
    arrays[bad] = np.zeros((7, 7), dtype=np.float32)
    with pytest.raises(ValueError, match=rf"{keys[bad]}.*\(7, 7\).*expected") as info:
        set_arrays(model, arrays, "all")
    assert repr(keys[bad]) in str(info.value)
    for key, value in _state(model).items():
        assert torch.equal(value, before[key]), key


def test_unknown_or_empty_group_raises():
    model = _model(0)
    for group in ["encoder", "head:x", "head:", "Heads"]:
        with pytest.raises(ValueError, match="unknown parameter group"):
            get_arrays(model, group)
    with pytest.raises(ValueError, match="empty"):
        get_arrays(model, "head:3")
    with pytest.raises(ValueError, match="empty"):
        set_arrays(model, [], "head:3")


def test_group_parameters_are_parameters_only():
    model = _model(0)
    names = {id(p): n for n, p in model.named_parameters()}
    body = group_parameters(model, ["body"])
    assert [names[id(p)] for p in body] == [n for n, _ in model.named_parameters() if n.startswith("encoder.")]
    both = group_parameters(model, ["head:0", "head:2"])
    assert [names[id(p)] for p in both] == ["heads.0.weight", "heads.0.bias", "heads.2.weight", "heads.2.bias"]
    assert len(group_parameters(model, ["all"])) == len(list(model.parameters()))


@pytest.mark.parametrize(
    "groups, trainable_prefixes",
    [
        (["all"], ("",)),
        (["body"], ("encoder.",)),
        (["heads"], ("heads.",)),
        (["head:1"], ("heads.1.",)),
        (["body", "head:2"], ("encoder.", "heads.2.")),
    ],
)
def test_only_trainable_freezes_exactly_the_other_groups(groups, trainable_prefixes):
    model = _model(0)
    model.heads[0].bias.requires_grad_(False)  # a user's own frozen parameter
    previous = {n: p.requires_grad for n, p in model.named_parameters()}
    with only_trainable(model, groups) as params:
        expected = [p for n, p in model.named_parameters() if n.startswith(trainable_prefixes)]
        assert [id(p) for p in params] == [id(p) for p in expected]
        for name, p in model.named_parameters():
            assert p.requires_grad == name.startswith(trainable_prefixes), name
    assert {n: p.requires_grad for n, p in model.named_parameters()} == previous


def test_only_trainable_restores_after_exception():
    model = _model(0)
    model.encoder[0].bias.requires_grad_(False)
    previous = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="boom"):
        with only_trainable(model, ["heads"]):
            assert not model.encoder[0].weight.requires_grad
            raise RuntimeError("boom")
    assert {n: p.requires_grad for n, p in model.named_parameters()} == previous


def test_only_trainable_blocks_gradients_to_frozen_groups():
    model = _model(0)
    x = torch.randn(8, 4)
    with only_trainable(model, ["head:1"]):
        model(x, torch.ones(8, dtype=torch.long)).sum().backward()
    for name, p in model.named_parameters():
        if name.startswith("heads.1."):
            assert p.grad is not None and p.grad.abs().sum() > 0
        else:
            assert p.grad is None, name


def test_round_trip_between_built_models_with_batchnorm():
    torch.manual_seed(0)
    a = build_model("cnn28", (1, 28, 28), num_outputs=10, num_heads=2)
    b = build_model("cnn28", (1, 28, 28), num_outputs=10, num_heads=2)
    set_arrays(b, get_arrays(a, "body"), "body")
    x = torch.randn(3, 1, 28, 28)
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a.features(x), b.features(x))
        assert not torch.equal(a(x, torch.zeros(3, dtype=torch.long)), b(x, torch.zeros(3, dtype=torch.long)))
    set_arrays(b, get_arrays(a, "heads"), "heads")
    with torch.no_grad():
        assert torch.equal(a(x, torch.tensor([0, 1, 1])), b(x, torch.tensor([0, 1, 1])))
