"""split_model / HeadSplit: a user's own model seen as body + head(s), its modules, weights and
forward kept, with one clear message for every model that does not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fakes import QuickNet
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import EncoderHeadModel, HeadSplit, split_model
from flwr_pfl.models.split import check_head
from flwr_pfl.training import get_arrays, group_keys, group_parameters, set_arrays

BODY = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def _net(seed: int = 0) -> QuickNet:
    torch.manual_seed(seed)
    return QuickNet()


def _x(n: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _penultimate(net: QuickNet, x: torch.Tensor) -> torch.Tensor:
    """What quickstart's forward feeds fc3, computed by hand."""
    x = net.pool(torch.relu(net.conv1(x)))
    x = net.pool(torch.relu(net.conv2(x)))
    return torch.relu(net.fc2(torch.relu(net.fc1(torch.flatten(x, 1)))))


# ---------------------------------------------------------------- what is kept


@pytest.mark.parametrize("head", ["fc3", "fc3.", ["fc3"], lambda key: key.startswith("fc3."), "MODULE"])
def test_every_way_of_naming_the_head_keeps_the_users_module_and_weights(head):
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    split = split_model(net, net.fc3 if head == "MODULE" else head)
    assert split.module is net and split.heads[0] is net.fc3 and split.head_name == "fc3"
    assert split.num_heads == 1 and split.feature_dim == 12 and split.num_outputs == 3
    assert list(split.user_state_dict()) == list(before)
    for key, value in split.user_state_dict().items():
        assert torch.equal(value, before[key])
    assert group_keys(split, "heads") == ["module.fc3.weight", "module.fc3.bias"]
    assert group_keys(split, "body") == [f"module.{k}" for k in BODY]
    assert group_keys(split, "head:0") == group_keys(split, "heads")


def test_forward_is_the_users_forward_and_features_are_what_it_feeds_the_head():
    net = _net()
    split = split_model(net, "fc3")
    x = _x()
    assert torch.equal(split(x), net(x))
    assert torch.equal(split(x, torch.zeros(5, dtype=torch.long)), net(x))
    z = split.features(x)
    assert torch.equal(z, _penultimate(net, x))
    assert torch.equal(split.head_outputs(z, None), net(x))


def test_features_keep_the_graph_to_the_body():
    split = split_model(_net(), "fc3")
    split.features(_x()).sum().backward()
    assert split.module.conv1.weight.grad is not None and split.module.fc3.weight.grad is None


def test_the_first_features_call_checks_forward_without_drawing_random_numbers_or_moving_statistics():
    """The one-time check runs in eval mode: afterwards, training-mode features() draw dropout
    and update BatchNorm exactly as one pass of the user's forward up to the head."""

    class Net(QuickNet):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(12)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.fc3(self.drop(self.bn(_penultimate(self, x))))

    x = _x(8)
    torch.manual_seed(0)
    net, reference = Net(), Net()
    reference.load_state_dict(net.state_dict())
    split = split_model(net, "fc3")
    torch.manual_seed(11)
    z = split.features(x)
    torch.manual_seed(11)
    expected = reference.drop(reference.bn(_penultimate(reference, x)))
    assert torch.equal(z, expected)
    assert torch.equal(net.bn.running_mean, reference.bn.running_mean)
    assert int(net.bn.num_batches_tracked) == 1 and net.training and net.drop.training


def test_a_prefix_list_over_several_modules_names_parameters_only():
    net = _net()
    split = split_model(net, ["fc2", "fc3"])
    assert not split.splits_features and split.head_name is None
    assert group_keys(split, "heads") == ["module.fc2.weight", "module.fc2.bias", "module.fc3.weight", "module.fc3.bias"]
    assert torch.equal(split(_x()), net(_x()))
    with pytest.raises(ConfigError, match=r"features\(\) needs the model's head as one module; QuickNet's head is "
                                          r"\['fc2', 'fc3'\].*modules: conv1, conv2, fc1, fc2, fc3\)"):
        split.features(_x())


def test_a_nested_head_is_named_with_dots_and_a_container_covering_one_layer_is_that_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)))
    split = split_model(net, "2.2")
    assert split.heads[0] is net[2][2] and split.feature_dim == 4 and split.num_outputs == 2
    assert group_keys(split, "heads") == ["module.2.2.weight", "module.2.2.bias"]
    whole = split_model(net, lambda k: k.startswith("2."))  # the container "2" exactly
    assert whole.head_name == "2" and whole.feature_dim == 5 and whole.num_outputs == 2
    x = torch.randn(3, 6)
    assert torch.equal(whole.head_outputs(whole.features(x), None), net(x))


# ---------------------------------------------------------------- wire order


class HeadFirst(nn.Module):
    """A model that registers its head before its body (and has a BatchNorm buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(4, 3)
        self.body = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.ReLU())

    def forward(self, x):
        return self.classifier(self.body(x))


def test_the_wire_puts_the_body_first_and_the_heads_last_whatever_the_registration_order():
    torch.manual_seed(0)
    net = HeadFirst()
    split = split_model(net, "classifier", num_heads=2)
    keys = list(split.state_dict())
    assert keys == [
        "module.body.0.weight", "module.body.0.bias", "module.body.1.weight", "module.body.1.bias",
        "module.body.1.running_mean", "module.body.1.running_var", "module.body.1.num_batches_tracked",
        "module.classifier.weight", "module.classifier.bias", "extra_heads.0.weight", "extra_heads.0.bias",
    ]
    assert group_keys(split, "all") == keys
    assert list(split.user_state_dict()) == list(net.state_dict())  # the user's own order back
    arrays = get_arrays(split)
    other = split_model(HeadFirst(), "classifier", num_heads=2)
    set_arrays(other, arrays)
    for a, b in zip(get_arrays(other), arrays):
        np.testing.assert_array_equal(a, b)
    outer = nn.ModuleDict({"split": split})  # nested: the same order under the prefix
    assert list(outer.state_dict()) == [f"split.{k}" for k in keys]
    copy = split_model(HeadFirst(), "classifier", num_heads=2)
    copy.load_state_dict(split.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), split.state_dict().values()))


# ---------------------------------------------------------------- several heads


def test_several_heads_are_copies_of_the_users_head_and_route_samples_by_domain():
    net = _net()
    split = split_model(net, "fc3", num_heads=3)
    heads = list(split.heads)
    assert heads[0] is net.fc3 and all(h is not net.fc3 for h in heads[1:])
    for h in heads[1:]:
        assert torch.equal(h.weight, net.fc3.weight) and torch.equal(h.bias, net.fc3.bias)
    with torch.no_grad():
        heads[1].weight.add_(1.0)
        heads[2].bias.sub_(2.0)
    x, domain = _x(6), torch.tensor([0, 1, 2, 2, 1, 0])
    z = _penultimate(net, x)
    out = split(x, domain)
    for i, m in enumerate(domain.tolist()):
        assert torch.allclose(out[i], heads[m](z[i : i + 1])[0])
    assert group_keys(split, "head:2") == ["extra_heads.1.weight", "extra_heads.1.bias"]
    assert group_keys(split, "head:0") == ["module.fc3.weight", "module.fc3.bias"]
    assert len(group_keys(split, "heads")) == 6
    head2 = split.user_state_dict(head=2)
    assert torch.equal(head2["fc3.bias"], heads[2].bias) and torch.equal(head2["fc1.weight"], net.fc1.weight)
    assert torch.equal(split.user_state_dict()["fc3.bias"], net.fc3.bias)
    with pytest.raises(ValueError, match=r"a model with 3 heads needs each sample's domain label"):
        split(x)


def test_parameter_groups_train_exactly_the_named_part():
    split = split_model(_net(), "fc3", num_heads=2)
    heads = {id(p) for p in group_parameters(split, ["heads"])}
    body = {id(p) for p in group_parameters(split, ["body"])}
    assert heads == {id(p) for h in split.heads for p in h.parameters()}
    assert body == {id(p) for name, p in split.module.named_parameters() if not name.startswith("fc3.")}


# ---------------------------------------------------------------- refusals


def test_an_unknown_module_name_lists_the_modules_and_suggests_close_names():
    with pytest.raises(ConfigError, match=r"^head='fc' is not a module of QuickNet \(did you mean 'fc3' or 'fc2' or "
                                          r"'fc1'\?\); its modules with parameters are: conv1, conv2, fc1, fc2, fc3$"):
        split_model(_net(), "fc")


@pytest.mark.parametrize("head, message", [
    (["fc3", "fc9"], r"head prefix 'fc9' matches no parameter of QuickNet.*its parameter names are: conv1.weight"),
    ("pool", r"the head 'pool' holds no parameters of QuickNet; its modules with parameters are: conv1,"),
    (lambda k: True, r"covers every parameter of QuickNet, which leaves no body"),
    (nn.Linear(12, 3), r"the head module given \(Linear\) is not a submodule of QuickNet; name one of"),
    ([], r"head=\[\] names no parameters"),
])
def test_heads_that_name_nothing_or_everything_are_refused(head, message):
    with pytest.raises(ConfigError, match=message):
        split_model(_net(), head)


def test_a_head_of_the_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match=r"head must be a module name, a module, a list of parameter-name prefixes"):
        split_model(_net(), 3)  # type: ignore[arg-type]


def test_an_already_split_model_is_not_split_again():
    with pytest.raises(ConfigError, match=r"already split into body and head\(s\) \(a HeadSplit\); pass it as it is"):
        split_model(split_model(_net(), "fc3"), "fc3")
    with pytest.raises(ConfigError, match=r"\(a EncoderHeadModel\)"):
        split_model(EncoderHeadModel(nn.Flatten(), 4, 2), "heads.0")


def test_several_heads_need_the_head_as_one_module():
    with pytest.raises(ConfigError, match=r"building 3 heads as copies of the head needs the model's head as one module; "
                                          r"the head \['fc2', 'fc3'\] is not one module of QuickNet"):
        split_model(_net(), ["fc2", "fc3"], num_heads=3)


def test_features_refuse_a_forward_that_does_something_after_the_head():
    class Softmaxed(QuickNet):
        def forward(self, x):
            return F.log_softmax(super().forward(x), dim=1)

    split = split_model(Softmaxed(), "fc3")
    assert torch.equal(split(_x()), split.module(_x()))  # forward itself is fine
    with pytest.raises(ConfigError, match=r"Softmaxed.forward returns something computed after its head 'fc3'.*"
                                          r"head_outputs\(features\(x\)\) equals model\(x\)"):
        split.features(_x())


def test_features_refuse_a_head_that_does_not_take_flat_features():
    with pytest.raises(ConfigError, match=r"Net.forward returns something computed after its head 'conv2'"):
        split_model(_net(), "conv2").features(_x())

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Conv2d(3, 2, 3)
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * 14 * 14, 3))

        def forward(self, x):
            return self.head(self.body(x))

    with pytest.raises(ConfigError, match=r"features\(\) must have shape \(batch, 392\), but Flat's head 'head' receives "
                                          r"a tensor of shape \(5, 2, 14, 14\)"):
        split_model(Flat(), "head").features(_x())
    with pytest.raises(ConfigError, match=r"features\(\) must have shape \(batch, 7\), but QuickNet's head 'fc3' "
                                          r"receives a tensor of shape \(5, 12\)"):
        split_model(_net(), "fc3", feature_dim=7).features(_x())


def test_features_refuse_a_head_that_forward_never_calls_or_calls_twice():
    class Unused(QuickNet):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Linear(12, 3)

    with pytest.raises(ConfigError, match=r"Unused.forward never called its head 'spare'"):
        split_model(Unused(), "spare").features(_x())

    class Twice(QuickNet):
        def forward(self, x):
            z = _penultimate(self, x)
            return self.fc3(z) + self.fc3(z)

    with pytest.raises(ConfigError, match=r"Twice.forward calls its head 'fc3' 2 times"):
        split_model(Twice(), "fc3").features(_x())


def test_unknown_widths_say_how_to_give_them():
    class ConvHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Conv2d(3, 4, 3)
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return self.head(self.body(x))

    split = split_model(ConvHead(), "head")
    with pytest.raises(ConfigError, match=r"the input width of ConvHead's head \('head'\) is unknown: it has no "
                                          r"nn.Linear to read it from; give split_model\(..., feature_dim=...\)"):
        _ = split.feature_dim
    assert split_model(ConvHead(), "head", feature_dim=4, num_outputs=2).num_outputs == 2


def test_check_head_says_what_each_requirement_misses():
    check_head(split_model(_net()), "none", "FedAvg")
    with pytest.raises(ConfigError, match=r"^FedRep needs to know which part of the model is its head; none was named\. "
                                          r"Pass head= to the client: the name of the head module \(one of QuickNet's "
                                          r"modules: conv1, conv2, fc1, fc2, fc3\)"):
        check_head(split_model(_net()), "parameters", "FedRep")
    check_head(split_model(_net(), ["fc2", "fc3"]), "parameters", "FedRep")
    with pytest.raises(ConfigError, match=r"^pFedFDA needs the model's head as one module"):
        check_head(split_model(_net(), ["fc2", "fc3"]), "module", "pFedFDA")
    check_head(split_model(_net(), "fc3"), "module", "pFedFDA")
    check_head(EncoderHeadModel(nn.Flatten(), 4, 2), "module", "pFedFDA")


def test_a_model_without_a_split_has_only_the_group_all():
    net = _net()
    assert len(get_arrays(net)) == len(net.state_dict())
    with pytest.raises(ValueError, match=r"parameter group 'body' needs a model split into body and head\(s\); this "
                                         r"QuickNet is not: name its head with flwr_pfl.models.split_model"):
        group_keys(net, "body")
    with pytest.raises(ValueError, match=r"parameter group 'heads' is empty for this model"):
        group_keys(split_model(net), "heads")


def test_head_split_is_an_nn_module_that_deep_copies_with_its_own_head():
    import copy

    split = split_model(_net(), "fc3", num_heads=2)
    clone = copy.deepcopy(split)
    assert clone.heads[0] is clone.module.fc3 and clone.heads[0] is not split.heads[0]
    x = _x()
    assert torch.equal(clone(x, torch.zeros(5, dtype=torch.long)), split(x, torch.zeros(5, dtype=torch.long)))
    assert isinstance(clone, HeadSplit) and "head=fc3, num_heads=2" in repr(clone)
