"""Optimizers and schedulers by their torch names: the training loop with
``OptimizerConfig(name=..., options=..., scheduler=...)`` must give exactly what a hand-written
loop with the torch objects gives, and bad names or options must say what is valid."""

from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import get_arrays, train
from flwr_pfl.training import optim
from flwr_pfl.training.optim import OPTIMIZERS, SCHEDULERS, OptimizerConfig, make_optimizer

CPU = torch.device("cpu")
G = torch.Generator().manual_seed(11)
X = torch.randn(24, 5, generator=G)
Y = torch.randint(0, 3, (24,), generator=G)
LOADER = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=False)  # 3 steps per epoch


def model() -> EncoderHeadModel:
    torch.manual_seed(4)
    return EncoderHeadModel(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 3)


def by_hand(start: EncoderHeadModel, make_opt, make_sched=None, epochs: int = 2) -> tuple[list, list[float]]:
    """The reference loop: the same batches and per-sample mean loss, the torch objects built here;
    the scheduler (if any) stepped after every optimizer step. Returns arrays and the lr per step."""
    m = copy.deepcopy(start)
    opt = make_opt(list(m.parameters()))
    sched = make_sched(opt) if make_sched else None
    lrs = []
    for _ in range(epochs):
        for x, y in LOADER:
            loss = F.cross_entropy(m(x, torch.zeros(len(x), dtype=torch.long)), y, reduction="none").mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            if sched is not None:
                sched.step()
    return get_arrays(m), lrs


def trained(start: EncoderHeadModel, config: OptimizerConfig, epochs: int = 2) -> list:
    m = copy.deepcopy(start)
    train(m, LOADER, optimizer=config, device=CPU, epochs=epochs)
    return get_arrays(m)


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))


@pytest.mark.parametrize(
    ("config", "torch_optimizer"),
    [
        (OptimizerConfig("AdamW", 0.01, weight_decay=0.05, options={"betas": (0.8, 0.95), "amsgrad": True}),
         lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05, betas=(0.8, 0.95), amsgrad=True)),
        (OptimizerConfig("rmsprop", 0.005, momentum=0.6, weight_decay=0.01, options={"alpha": 0.9, "centered": True}),
         lambda p: torch.optim.RMSprop(p, lr=0.005, momentum=0.6, weight_decay=0.01, alpha=0.9, centered=True)),
        (OptimizerConfig("NADAM", 0.02, options={"momentum_decay": 0.01}),
         lambda p: torch.optim.NAdam(p, lr=0.02, weight_decay=0.0, momentum_decay=0.01)),
        (OptimizerConfig("sgd", 0.1, momentum=0.9, weight_decay=0.01, options={"nesterov": True}),
         lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    ],
    ids=["adamw", "rmsprop", "nadam", "sgd-nesterov"],
)
def test_an_optimizer_by_name_trains_as_the_torch_object(config, torch_optimizer):
    start = model()
    expected, _ = by_hand(start, torch_optimizer)
    assert_same(trained(start, config), expected)
    plain = trained(start, OptimizerConfig(learning_rate=config.learning_rate))
    assert any(not torch.allclose(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(plain, expected))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_offered_name_builds_its_torch_class(name):
    params = [nn.Parameter(torch.zeros(3, 2))]
    opt = make_optimizer(params, OptimizerConfig(name.upper(), 0.002))
    assert type(opt).__name__.lower() == name and opt.param_groups[0]["lr"] == 0.002


def test_sgd_and_adam_keep_their_settings():
    """The two optimizers offered before names were opened up are built as they always were
    (Adam takes no momentum; SGD gets momentum and weight decay)."""
    params = [nn.Parameter(torch.zeros(2))]
    sgd = make_optimizer(params, OptimizerConfig("sgd", 0.2, 0.5, 0.01))
    adam = make_optimizer(params, OptimizerConfig("adam", 0.003, momentum=0.7, weight_decay=0.1))
    assert (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["weight_decay"], sgd.param_groups[0]["nesterov"]) == (0.5, 0.01, False)
    assert adam.param_groups[0]["betas"] == (0.9, 0.999) and adam.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("config", "torch_scheduler"),
    [
        (OptimizerConfig("sgd", 0.4, scheduler="StepLR", scheduler_options={"step_size": 2, "gamma": 0.25}),
         lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.25)),
        (OptimizerConfig("sgd", 0.4, momentum=0.5, scheduler="onecyclelr", scheduler_options={"max_lr": 0.8, "total_steps": 6}),
         lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.8, total_steps=6)),
        (OptimizerConfig("adamw", 0.01, scheduler="linearlr", scheduler_options={"start_factor": 0.1, "total_iters": 4}),
         lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4)),
    ],
    ids=["steplr", "onecyclelr", "linearlr-warmup"],
)
def test_a_scheduler_by_name_steps_after_every_optimizer_step(config, torch_scheduler):
    start = model()
    base = OptimizerConfig(config.name, config.learning_rate, config.momentum, config.weight_decay)
    expected, lrs = by_hand(start, lambda p: make_optimizer(p, base), torch_scheduler)
    assert len(set(lrs)) > 1  # the rate did move within the call
    assert_same(trained(start, config), expected)
    assert any(not torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(trained(start, base), expected))


def test_a_scheduler_restarts_with_every_training_call():
    """A round (one call of the loop) starts from the configured rate, whatever the last round did."""
    config = OptimizerConfig("sgd", 0.4, scheduler="exponentiallr", scheduler_options={"gamma": 0.5})
    start = model()
    once = copy.deepcopy(start)
    train(once, LOADER, optimizer=config, device=CPU, epochs=1)
    twice = copy.deepcopy(start)
    train(twice, LOADER, optimizer=config, device=CPU, epochs=1)
    expected, _ = by_hand(once, lambda p: torch.optim.SGD(p, lr=0.4), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5), epochs=1)
    train(twice, LOADER, optimizer=config, device=CPU, epochs=1)
    assert_same(get_arrays(twice), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "adamx"}, r"optimizer='adamx' is unknown \(did you mean adamax.*allowed .*adamw.*rmsprop.*sgd"),
        ({"name": "lbfgs"}, "LBFGS needs a closure"),
        ({"name": "sparseadam"}, "sparse gradients"),
        ({"name": "adamw", "options": {"beta": (0.9, 0.99)}}, r"AdamW has no option 'beta' \(did you mean betas\?\); its options: betas"),
        ({"name": "adamw", "options": {"betas": (1.2, 0.99)}}, "AdamW refused its settings: Invalid beta parameter"),
        ({"name": "adam", "options": {"lr": 0.1}}, "Adam's 'lr' cannot be set in the optimizer options: set it with learning_rate"),
        ({"name": "rprop", "weight_decay": 0.1}, "Rprop has no weight decay"),
        ({"scheduler": "steplr"}, r"StepLR refused its settings: .*step_size.*\(its options: step_size, gamma"),
        ({"scheduler": "steplr", "scheduler_options": {"step": 2}}, r"StepLR has no option 'step' \(did you mean step_size"),
        ({"scheduler": "cosineannealing", "scheduler_options": {"T_max": 3}}, "did you mean cosineannealinglr"),
        ({"scheduler": "ReduceLROnPlateau"}, "needs a validation metric"),
        ({"scheduler_options": {"gamma": 0.5}}, "no lr-scheduler is named"),
    ],
)
def test_bad_names_and_options_say_what_is_valid(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**kwargs)


def test_names_are_case_insensitive_and_configs_compare_and_hash():
    a = OptimizerConfig("AdamW", 0.01, options={"betas": [0.9, 0.99]}, scheduler="StepLR", scheduler_options={"step_size": 3})
    b = OptimizerConfig("adamw", 0.01, options={"betas": (0.9, 0.99)}, scheduler="steplr", scheduler_options={"step_size": 3})
    assert a == b and hash(a) == hash(b) and a.name == "adamw" and a.scheduler == "steplr"
    assert a.scaled(0.5) == OptimizerConfig("adamw", 0.005, options={"betas": (0.9, 0.99)}, scheduler="steplr",
                                            scheduler_options={"step_size": 3})
    assert "sgd" in OPTIMIZERS and "onecyclelr" in SCHEDULERS and "lbfgs" not in OPTIMIZERS


# ------------------------------------------------------------------ every refusal in full, at its boundary
def refusal(**kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        OptimizerConfig(**kwargs)
    return str(err.value)


def test_a_refused_or_unknown_name_gives_the_reason_and_the_whole_list_of_names():
    names = ", ".join(OPTIMIZERS)
    assert refusal(name="LBFGS") == (
        "optimizer='LBFGS' is not supported: LBFGS needs a closure that re-evaluates the loss at every step, "
        f"which the training loop does not give; allowed: {names}")
    assert refusal(name="zzzz") == f"optimizer='zzzz' is unknown; allowed (torch names, any case): {names}"
    assert refusal(name="adamx") == (
        f"optimizer='adamx' is unknown (did you mean adamax, adam, radam?); allowed (torch names, any case): {names}")
    assert refusal(scheduler="chainedscheduler") == (
        "lr-scheduler='chainedscheduler' is not supported: ChainedScheduler takes other scheduler objects, not options; "
        f"allowed: {', '.join(SCHEDULERS)}")
    assert refusal(name=3) == "optimizer=3 must be a name (a string)"
    assert "optimizer" not in OPTIMIZERS and "lrscheduler" not in SCHEDULERS and "reducelronplateau" not in SCHEDULERS
    assert not any(name.startswith("_") for name in OPTIMIZERS + SCHEDULERS)


def test_the_numeric_settings_are_refused_just_outside_their_ranges():
    OptimizerConfig(learning_rate=1e-12, momentum=0.0, weight_decay=0.0)
    OptimizerConfig(momentum=0.999)
    assert refusal(learning_rate=0.0) == "OptimizerConfig(learning_rate=...) (run config learning-rate) must be > 0, got 0.0"
    assert refusal(momentum=1.0) == "momentum must be in [0, 1), got 1.0"
    assert refusal(momentum=-1e-9) == "momentum must be in [0, 1), got -1e-09"
    assert refusal(weight_decay=-1e-9) == (
        "OptimizerConfig(weight_decay=...) (run config weight-decay) must be >= 0, got -1e-09")
    assert refusal(name="rprop", weight_decay=0.1) == "Rprop has no weight decay; set weight-decay to 0 (got 0.1)"
    OptimizerConfig(name="rprop", weight_decay=0.0)


def own_options(cls: type) -> str:
    """The keyword options of a torch class after its first argument, less the ones the config
    sets itself (lr, momentum, weight_decay), in signature order."""
    params = list(inspect.signature(cls).parameters.values())[1:]
    return ", ".join(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and p.name not in ("lr", "momentum", "weight_decay"))


def torch_error(build) -> str:
    with pytest.raises((TypeError, ValueError)) as err:
        build()
    return str(err.value)


def test_option_names_are_checked_with_the_options_the_class_takes():
    sgd_options = own_options(torch.optim.SGD)
    assert sgd_options.startswith("dampening, nesterov")
    assert refusal(options={"zzzz": 1}) == f"SGD has no option 'zzzz'; its options: {sgd_options}"
    assert refusal(options={"nesterv": True}) == f"SGD has no option 'nesterv' (did you mean nesterov?); its options: {sgd_options}"
    assert refusal(options={"params": 1}) == "SGD's 'params' cannot be set in the optimizer options"
    assert refusal(options={"momentum": 0.5}) == "SGD's 'momentum' cannot be set in the optimizer options: set it with momentum"
    assert refusal(options={"weight_decay": 0.5}) == (
        "SGD's 'weight_decay' cannot be set in the optimizer options: set it with weight_decay (run config: weight-decay)")
    assert refusal(options={1: 2}) == "optimizer option names must be strings, got 1"
    assert refusal(scheduler="steplr", scheduler_options={2: 1}) == "lr-scheduler option names must be strings, got 2"
    assert refusal(scheduler="steplr", scheduler_options={"optimizer": 1, "step_size": 2}) == (
        "StepLR's 'optimizer' cannot be set in the lr-scheduler options")
    assert refusal(scheduler_options={"gamma": 0.5}) == "lr-scheduler-options are set but no lr-scheduler is named"
    assert refusal(scheduler="cycliclr", scheduler_options={"cycle_momentm": True}) == (
        "CyclicLR has no option 'cycle_momentm' (did you mean cycle_momentum, base_momentum, max_momentum?); its options: "
        f"{own_options(torch.optim.lr_scheduler.CyclicLR)}")  # three suggestions at most (scale_mode is a fourth)
    assert OptimizerConfig(options=[("nesterov", False), ("dampening", 0.0)]).options == (
        ("dampening", 0.0), ("nesterov", False))  # pairs accepted too, sorted by name
    assert refusal(options=[("dampening", 0.1), ("dampening", 0.0)]) == "optimizer option 'dampening' is given twice"


def test_a_value_torch_refuses_names_the_class_and_its_options():
    p = [torch.nn.Parameter(torch.zeros(2))]
    said = torch_error(lambda: torch.optim.AdamW(p, betas=(1.2, 0.99)))
    assert refusal(name="adamw", options={"betas": (1.2, 0.99)}) == (
        f"optimizer AdamW refused its settings: {said} (its options: {own_options(torch.optim.AdamW)})")
    said = torch_error(lambda: torch.optim.lr_scheduler.StepLR(torch.optim.SGD(p, lr=0.1)))
    assert refusal(scheduler="steplr") == (
        f"lr-scheduler StepLR refused its settings: {said} (its options: {own_options(torch.optim.lr_scheduler.StepLR)})")
    assert own_options(torch.optim.lr_scheduler.StepLR).startswith("step_size, gamma")


def test_momentum_and_weight_decay_reach_only_the_optimizers_that_take_them():
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = make_optimizer(params, OptimizerConfig("sgd", 0.1, momentum=0.7, weight_decay=0.01))
    assert (sgd.defaults["lr"], sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (0.1, 0.7, 0.01)
    adam = make_optimizer(params, OptimizerConfig("adam", 0.2, momentum=0.7, weight_decay=0.03))
    assert "momentum" not in adam.defaults and (adam.defaults["lr"], adam.defaults["weight_decay"]) == (0.2, 0.03)
    rprop = make_optimizer(params, OptimizerConfig("rprop", 0.3, momentum=0.7))
    assert "momentum" not in rprop.defaults and "weight_decay" not in rprop.defaults


def test_the_offered_classes_are_every_public_subclass_of_the_base_but_the_base():
    class Base:
        pass

    class One(Base):
        pass

    class _Hidden(Base):
        pass

    module = types.SimpleNamespace(Base=Base, OneOpt=One, _Hidden=_Hidden, Other=int, value=3, Alias=One)
    assert optim._classes(module, Base) == {"oneopt": One, "alias": One}
    expected = {name.lower(): cls for name, cls in vars(torch.optim).items()
                if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
                and not name.startswith("_")}
    assert optim._classes(torch.optim, torch.optim.Optimizer) == expected
