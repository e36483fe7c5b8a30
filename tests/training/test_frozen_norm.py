"""A frozen part keeps its BatchNorm statistics (``frozen-norm = "eval"``, the default) or lets
them move as the reference codes do (``"train"``), in every algorithm that trains part of the
model: FedRep's head and body phases, FedDAR's head phase (features cached or not) and its
representation phase, FMTL's phase 2 and pFedFDA's backbone training. The part being trained
always updates its own statistics, and dropout stays active in the frozen part.

Every case runs a real client's ``fit`` on a tiny synthetic batch, with a user's model that has
BatchNorm in its body (and, for FedRep, in its head) and dropout in its body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.clients import FedDARClient, FedFMTLClient, FedRepClient, LocalData, PFedFDAClient, TrainConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.feddar import PHASE_KEY
from flwr_pfl.training import FROZEN_NORMS, OptimizerConfig, frozen_norm_modules, frozen_norms, train
from flwr_pfl.training.norms import check_frozen_norm

CLASSES, DOMAINS, WIDTH = 3, 2, 8
#: BatchNorm modules of BNNet, by the user's module names
BODY_BN = ("body.1", "neck")
HEAD_BN = "head.0"


class BNNet(nn.Module):
    """A user's model with BatchNorm and dropout: body (Linear, BatchNorm, ReLU, Dropout), a
    BatchNorm ``neck``, then ``head`` (a BatchNorm and the final Linear). Naming ``head`` as the
    head puts a BatchNorm in it; naming ``head.1`` leaves every BatchNorm in the body."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Dropout(0.5))
        self.neck = nn.BatchNorm1d(WIDTH)
        self.head = nn.Sequential(nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(self.body(x)))


def _data(n: int = 24) -> LocalData:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % CLASSES
    x = 3.0 * torch.randn(n, 6, generator=g) + y[:, None].float() + 2.0  # far from BN's initial stats
    d = (torch.arange(n) % 3 == 0).long()
    loader = DataLoader(TensorDataset(x, y, d), batch_size=8, shuffle=True)
    return LocalData(loader, DataLoader(TensorDataset(x, y, d), batch_size=8), num_domains=DOMAINS)


def _context() -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def _config(frozen_norm: str | None, epochs: int = 1) -> TrainConfig:
    extra = {} if frozen_norm is None else {"frozen_norm": frozen_norm}
    return TrainConfig(local_epochs=epochs, batch_size=8, optimizer=OptimizerConfig("sgd", 0.05), device="cpu", **extra)


def _bn_state(net: BNNet, name: str) -> dict[str, torch.Tensor]:
    module = net.get_submodule(name)
    return {k: v.detach().clone() for k, v in module.state_dict().items()
            if k in ("running_mean", "running_var", "num_batches_tracked")}


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _all_moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every running statistic differs and the batch counter grew."""
    return all(not torch.equal(a[k], b[k]) for k in a) and bool(b["num_batches_tracked"] > a["num_batches_tracked"])


# ------------------------------------------------------------------------------ the phases
def _fedrep_head_phase(net: BNNet, fn: str | None) -> None:
    client = FedRepClient(_context(), net, _data(), _config(fn, epochs=0), head="head", head_epochs=2)
    client.fit(client.get_parameters({}), {"server-round": 1})


def _fedrep_body_phase(net: BNNet, fn: str | None) -> None:
    client = FedRepClient(_context(), net, _data(), _config(fn, epochs=2), head="head", head_epochs=0)
    client.fit(client.get_parameters({}), {"server-round": 1})


def _feddar_head_phase(cache: bool) -> Callable[[BNNet, str | None], None]:
    def run(net: BNNet, fn: str | None) -> None:
        client = FedDARClient(_context(), net, _data(), _config(fn), head="head.1")
        config = {"server-round": 1, PHASE_KEY: "head", "epochs": 2, "cache-features": cache}
        client.fit(client.get_parameters({}), config)

    return run


def _feddar_rep_phase(net: BNNet, fn: str | None) -> None:
    client = FedDARClient(_context(), net, _data(), _config(fn), head="head.1")
    u = np.full(DOMAINS, 1.0, dtype=np.float32)
    client.fit([*client.get_parameters({}), u], {"server-round": 1, PHASE_KEY: "rep", "epochs": 2})


def _fmtl_phase2(net: BNNet, fn: str | None) -> None:
    client = FedFMTLClient(_context(), net, _data(), _config(fn, epochs=2), head="head.1")
    client.fit(client.get_parameters({}), {"server-round": 1, "fmtl-phase": 2})


def _pfedfda_fit(net: BNNet, fn: str | None) -> None:
    client = PFedFDAClient(_context(), net, _data(), _config(fn, epochs=2), head="head.1")
    client.fit(client.get_parameters({}), {"server-round": 1})


@dataclass(frozen=True)
class Phase:
    """A phase that trains part of the model: which BatchNorm modules it leaves frozen (their
    statistics must stay under ``eval``, except where ``moves_under_train`` is False, and move
    under ``train``) and which it trains (their statistics always move)."""

    run: Callable[[BNNet, str | None], None]
    frozen: tuple[str, ...]
    trained: tuple[str, ...]
    moves_under_train: bool = True


PHASES = {
    # head phase: the whole body (two BatchNorms) frozen, the head's BatchNorm trained
    "fedrep-head": Phase(_fedrep_head_phase, frozen=BODY_BN, trained=(HEAD_BN,)),
    # body phase: the head (with its BatchNorm) frozen, the body trained
    "fedrep-body": Phase(_fedrep_body_phase, frozen=(HEAD_BN,), trained=BODY_BN),
    # FedDAR's head phase on the encoder's running features (feddar.cache-features = false)
    "feddar-head": Phase(_feddar_head_phase(False), frozen=(*BODY_BN, HEAD_BN), trained=()),
    # cached features are computed once in eval mode: no BatchNorm runs in train mode at all
    "feddar-head-cached": Phase(_feddar_head_phase(True), frozen=(*BODY_BN, HEAD_BN), trained=(),
                                moves_under_train=False),
    # representation phase: the linear heads are frozen (nothing to normalise), the encoder trains
    "feddar-rep": Phase(_feddar_rep_phase, frozen=(), trained=(*BODY_BN, HEAD_BN)),
    # FMTL phase 2: the heads train on the frozen phase-1 body
    "fmtl-phase2": Phase(_fmtl_phase2, frozen=(*BODY_BN, HEAD_BN), trained=()),
    # pFedFDA: the backbone trains under the frozen LDA head (a Linear: nothing to normalise)
    "pfedfda": Phase(_pfedfda_fit, frozen=(), trained=(*BODY_BN, HEAD_BN)),
}


def _run(phase: Phase, frozen_norm: str | None) -> tuple[dict, dict]:
    torch.manual_seed(0)
    net = BNNet()
    names = (*phase.frozen, *phase.trained)
    before = {name: _bn_state(net, name) for name in names}
    phase.run(net, frozen_norm)
    return before, {name: _bn_state(net, name) for name in names}


@pytest.mark.parametrize("name", PHASES)
def test_the_frozen_part_keeps_its_batchnorm_statistics_by_default(name):
    """Default (no setting): a frozen BatchNorm's running_mean, running_var and
    num_batches_tracked are bit-identical after the phase; the trained part's all move."""
    phase = PHASES[name]
    before, after = _run(phase, None)
    for module in phase.frozen:
        assert _identical(before[module], after[module]), f"{name}: frozen {module} changed"
    for module in phase.trained:
        assert _all_moved(before[module], after[module]), f"{name}: trained {module} did not move"


@pytest.mark.parametrize("name", PHASES)
def test_frozen_norm_train_lets_the_frozen_statistics_move_as_the_reference_codes(name):
    phase = PHASES[name]
    before, after = _run(phase, "train")
    for module in phase.frozen:
        if phase.moves_under_train:
            assert _all_moved(before[module], after[module]), f"{name}: frozen {module} did not move"
        else:
            assert _identical(before[module], after[module]), f"{name}: {module} changed"
    for module in phase.trained:
        assert _all_moved(before[module], after[module]), f"{name}: trained {module} did not move"


# ------------------------------------------------------------------------------ modes in the loop
def _modes_seen(model: nn.Module, run: Callable[[], None]) -> dict[str, set[bool]]:
    """The train/eval mode every BatchNorm and Dropout module had at each forward during ``run``."""
    seen: dict[str, set[bool]] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, set()).add(mod.training))
        for name, m in model.named_modules()
        if isinstance(m, (nn.BatchNorm1d, nn.Dropout))
    ]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("frozen_norm", FROZEN_NORMS)
def test_dropout_in_the_frozen_body_stays_active_and_modes_come_back(frozen_norm):
    """FedRep's head phase: the frozen body's dropout is in train mode under both settings (it
    still regularises the head, as in the reference codes); the frozen BatchNorms are in eval
    mode only under ``eval``; after the phase every module is back in train mode."""
    torch.manual_seed(0)
    net = BNNet()
    client = FedRepClient(_context(), net, _data(), _config(frozen_norm, epochs=0), head="head", head_epochs=1)
    seen = _modes_seen(client.model, lambda: client.fit(client.get_parameters({}), {"server-round": 1}))
    frozen_mode = {False} if frozen_norm == "eval" else {True}
    assert seen["module.body.3"] == {True}  # Dropout
    assert seen["module.body.1"] == frozen_mode and seen["module.neck"] == frozen_mode
    assert seen["module.head.0"] == {True}
    assert all(m.training for m in client.model.modules())


def test_frozen_norm_modules_are_found_by_type_and_by_every_state_entry():
    """BatchNorm with or without affine parameters and InstanceNorm that tracks statistics are
    switched when frozen; GroupNorm, LayerNorm and statistics-free norms are left alone; a phase
    that trains everything freezes nothing."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.plain = nn.BatchNorm1d(4, affine=False)
            self.inorm = nn.InstanceNorm1d(4, track_running_stats=True)
            self.untracked = nn.BatchNorm1d(4, track_running_stats=False)
            self.gn = nn.GroupNorm(2, 4)
            self.ln = nn.LayerNorm(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.ln(self.gn(self.untracked(self.plain(self.bn(x))))))

    from flwr_pfl.models import split_model

    model = split_model(Mixed(), "fc")
    frozen = frozen_norm_modules(model, ("heads",))
    assert {id(m) for m in frozen} == {id(model.module.bn), id(model.module.plain), id(model.module.inorm)}
    assert frozen_norm_modules(model, ("body",)) == []
    assert frozen_norm_modules(model, ("all",)) == []
    model.train()
    with frozen_norms(model, ("heads",), "eval") as switched:
        assert len(switched) == 3 and not model.module.bn.training and model.module.gn.training
    assert model.module.bn.training
    with frozen_norms(model, ("heads",), "train") as switched:
        assert switched == [] and model.module.bn.training


def test_a_model_in_eval_mode_gets_its_frozen_norms_back_in_eval_mode():
    """The modes a block changes are restored as they were, not forced to train."""
    net = BNNet()
    from flwr_pfl.models import split_model

    model = split_model(net, "head")
    model.eval()
    with frozen_norms(model, ("heads",)):
        pass
    assert not any(m.training for m in model.modules())


def test_training_everything_moves_every_statistic_under_both_settings():
    for frozen_norm in FROZEN_NORMS:
        torch.manual_seed(0)
        net = BNNet()
        from flwr_pfl.models import split_model

        model = split_model(net, "head")
        before = {n: _bn_state(net, n) for n in (*BODY_BN, HEAD_BN)}
        train(model, _data().train, optimizer=OptimizerConfig("sgd", 0.05), device=torch.device("cpu"),
              groups=("all",), frozen_norm=frozen_norm)  # type: ignore[arg-type]
        for n in (*BODY_BN, HEAD_BN):
            assert _all_moved(before[n], _bn_state(net, n)), (frozen_norm, n)


def test_torchvision_mobilenet_body_is_frozen_in_fedrep_head_phase():
    """The model of the problem as users meet it: torchvision's MobileNetV3 (BatchNorm in the
    body, dropout in the classifier), its ``classifier`` the personal head."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.mobilenet_v3_small(num_classes=CLASSES)
    bns = [n for n, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.arange(8) % CLASSES
    data = LocalData(DataLoader(TensorDataset(x, y), batch_size=4), DataLoader(TensorDataset(x, y), batch_size=4))
    for frozen_norm, kept in (("eval", True), ("train", False)):
        net_copy = torchvision.models.mobilenet_v3_small(num_classes=CLASSES)
        net_copy.load_state_dict(net.state_dict())
        before = {n: _bn_state(net_copy, n) for n in bns}
        client = FedRepClient(_context(), net_copy, data, _config(frozen_norm, epochs=0), head="classifier", head_epochs=1)
        client.fit(client.get_parameters({}), {"server-round": 1})
        same = [_identical(before[n], _bn_state(net_copy, n)) for n in bns]
        assert all(same) if kept else not any(same), frozen_norm


# ------------------------------------------------------------------------------ configuration
def test_the_run_config_key_reaches_the_train_config_and_is_checked():
    assert parse_experiment({}).train_config.frozen_norm == "eval"
    assert parse_experiment({"frozen-norm": "train"}).train_config.frozen_norm == "train"
    with pytest.raises(ConfigError, match="frozen-norm='batch'.*'eval', 'train'"):
        parse_experiment({"frozen-norm": "batch"})
    with pytest.raises(ValueError, match="frozen-norm='batch'"):
        TrainConfig(frozen_norm="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError) as err:
        check_frozen_norm("Eval")
    assert str(err.value) == ("frozen-norm='Eval' is not allowed; choose 'eval' (a frozen part's BatchNorm statistics stay "
                              "as they are) or 'train' (they move, as in the reference codes)")
