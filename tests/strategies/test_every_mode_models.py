"""Every registered algorithm, in its Flower layer, with a user's model that has train/eval
behaviour (BatchNorm with running statistics and an integer step counter, and dropout) and with
the same network whose head is not the last module it registers (``layers.head``, second of four
in a ModuleDict).

Each run is a short in-process federation: three clients of unequal sizes (20, 28 and 38
training samples, two domains), two rounds, the model handed over as the user's own module with
``head=``, and a non-default option wherever one is cheap. The strategy's ``aggregate_fit`` and
the clients' ``fit`` / ``evaluate`` are wrapped to record what crosses the wire, and forward
pre-hooks on the BatchNorm and Dropout modules record the mode of every forward pass.

Every algorithm of the registry needs an entry in :data:`CASES` (what it does with the shared
BatchNorm statistics, whether its head is personal); a new algorithm without one fails
:func:`test_every_registered_algorithm_has_a_case` and each of its parametrized tests.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import Context
from flwr.client import ClientApp
from flwr.common import parameters_to_ndarrays
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from torch import nn

from fakes import BatchNormDropoutNet, MiddleHeadNet, split_loaders
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients import LocalData, TrainConfig
from flwr_pfl.training import OptimizerConfig

NUM_CLIENTS, ROUNDS = 3, 2
TRAIN_SIZES = (20, 28, 38)  # unequal; with batches of 8 no batch (nor domain batch) has 1 sample
TEST_SIZE = 10
#: the two user models, each with the name of its head module
MODELS = {"bn-dropout": (BatchNormDropoutNet, "fc2"), "head-in-middle": (MiddleHeadNet, "layers.head")}


@dataclass(frozen=True)
class Case:
    """What one algorithm does with the models, for the assertions below.

    Attributes:
        options: non-default values of the algorithm's options.
        buffers: how the server combines the shared BatchNorm statistics of the fit replies:
            ``mean`` (the example-weighted mean of every reply), ``mean-then-kept`` (the mean in
            the rounds up to ``fmtl.t1-rounds``, unchanged afterwards: heads-only rounds),
            ``sources-mean`` (the example-weighted mean of the source clients' replies, the
            target's left out), ``target`` (the target's reply), ``per-domain-mean`` (model m:
            the mean weighted by each client's samples of domain m), ``per-cluster-mean`` (cluster
            j's copy: the example-weighted mean of the replies that picked cluster j, the copy
            the round started from when none did), ``propagated`` (client k
            receives sum_j P[k, j] theta_j, P the propagation matrix), ``own-latest`` (client k
            receives its own latest uploaded statistics back: FedAMP combines parameters only, FedFomo
            mixes them on the client),
            ``never-sent`` (nothing
            crosses the wire) or ``kept-local`` (the rest of the model crosses the wire, the
            normalisation layers never do: each client's statistics are its own).
        personal_head: each client ends with its own head (else the server's one head).
        head_on_wire: the user's head tensors are among the arrays exchanged.
        evaluation_draws: why evaluation legitimately draws from torch's generator (then the
            two repeated evaluations run under the same random state); empty: it never does.
    """

    options: dict = field(default_factory=dict)
    buffers: str = "mean"
    personal_head: bool = False
    head_on_wire: bool = True
    evaluation_draws: str = ""


CASES: dict[str, Case] = {
    "fedavg": Case(),
    "local": Case(buffers="never-sent", personal_head=True, head_on_wire=False),
    "finetune": Case({"epochs": 2}, evaluation_draws="it fine-tunes a copy on shuffled batches first"),
    "fedrep": Case({"head_epochs": 2}, personal_head=True, head_on_wire=False),
    "fedper": Case(personal_head=True, head_on_wire=False),
    "fedprox": Case({"mu": 0.3}),
    "fedbn": Case(buffers="kept-local"),
    "lg-fedavg": Case(buffers="kept-local"),
    "fedbabu": Case({"finetune_epochs": 2}, evaluation_draws="it fine-tunes a copy on shuffled batches first"),
    "fedprox-ft": Case({"mu": 0.3, "epochs": 2}, evaluation_draws="it fine-tunes a copy on shuffled batches first"),
    "ditto": Case({"lam": 0.3, "personal_epochs": 2}),
    "apfl": Case({"alpha": 0.3, "alpha_lr": 0.05}),
    "per-fedavg": Case({"alpha": 0.05, "variant": "hf", "adapt_steps": 2},
                       evaluation_draws="it adapts a copy on shuffled training batches first"),
    "pfedme": Case({"lam": 5.0, "k": 3, "personal_lr": 0.02, "beta": 1.5}),
    "fedrod": Case(),
    "knn-per": Case({"k": 3, "lambda_step": 0.25, "capacity": 0.5, "temperature": 0.5}),
    "fedpac": Case({"lam": 2.0, "head_epochs": 2}, personal_head=True),
    "ifca": Case({"num_clusters": 3}, buffers="per-cluster-mean"),
    "feddar": Case({"head_epochs": 1, "rep_epochs": 2, "sa_weighting": "client_count"}),
    "feddar-sa": Case({"head_epochs": 1}),
    "feddar-wa": Case({"head_epochs": 2, "head_lr_scale": 0.5}),
    "fedavg-rw": Case(),
    "fedavg-mh": Case(),
    "separate-fedavg": Case(buffers="per-domain-mean"),
    "pfedfda": Case({"stats_source": "fresh_pass"}, personal_head=True, head_on_wire=False,
                    evaluation_draws="beta's cross-validation folds follow the order of the shuffled training loader"),
    "fedora": Case({"local_baseline": False}, buffers="propagated", personal_head=True),
    "pfedhn": Case({"inner_steps": 0, "embed_dim": 2, "hidden_dim": 7, "n_hidden": 1, "server_clip_norm": 0.5},
                   buffers="kept-local", personal_head=True),
    "fedfomo": Case({"num_models": 1, "epsilon": 0.5, "candidates": "all"}, buffers="own-latest", personal_head=True),
    "fedamp": Case({"alpha_k": 0.2, "lam": 0.5, "sigma": 2.0}, buffers="own-latest", personal_head=True),
    "fmtl": Case({"t1_rounds": 1, "body_weighting": "num_examples"}, buffers="mean-then-kept"),
    "fedgp": Case({"warmup_rounds": 1}, buffers="sources-mean"),
    "fedda": Case({"warmup_rounds": 1, "beta": 0.3}, buffers="sources-mean"),
    "target-only": Case({"target_batch_size": 8}, buffers="target"),
    "source-only": Case({"target_lr_ratio": 0.25}, buffers="sources-mean"),
}


def case_of(name: str) -> Case:
    if name not in CASES:
        pytest.fail(f"algorithm {name!r} is registered but has no case in CASES of {__name__}: add one "
                    "(what its server does with BatchNorm statistics, whether its head is personal)")
    return CASES[name]


# ------------------------------------------------------------------------------ data
def local_data(pid: int) -> LocalData:
    """Partition ``pid``: TRAIN_SIZES[pid] training samples, then validation and test splits of
    TEST_SIZE; 6 features shifted by the class (3) and the partition, domains alternating (2)."""
    n = TRAIN_SIZES[pid]
    total = n + 2 * TEST_SIZE
    g = torch.Generator().manual_seed(40 + pid)
    y = torch.arange(total) % 3
    d = torch.arange(total) % 2
    x = torch.randn(total, 6, generator=g) + y[:, None].float() + 0.5 * pid
    return split_loaders(x, y, d, n, TEST_SIZE)


def train_config() -> TrainConfig:
    return TrainConfig(batch_size=8, device="cpu", optimizer=OptimizerConfig(learning_rate=0.05), seed=1)


# ------------------------------------------------------------------------------ one recorded run
@dataclass
class Message:
    """One fit or evaluate message a client handled: what it received and what it answered."""

    pid: int
    kind: str  # "fit" or "evaluate"
    config: dict
    received: list[np.ndarray]
    reply: tuple


@dataclass
class Run:
    name: str
    model: str
    rows: list = field(default_factory=list)
    #: (round, [(partition id, num_examples, arrays, metrics) per fit reply], aggregate or None, strategy)
    aggregates: list = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    #: (phase, module type, module.training, grad enabled) of every BatchNorm / Dropout forward
    modes: list = field(default_factory=list)
    clients: dict = field(default_factory=dict)  # partition id -> (net, client) of the last message
    strategy: object = None
    grid: object = None
    phase: str = "build"


def _record_modes(net: nn.Module, run: Run) -> None:
    def hook(module, inputs):
        run.modes.append((run.phase, type(module).__name__, module.training, torch.is_grad_enabled()))

    for module in net.modules():
        if isinstance(module, (nn.BatchNorm1d, nn.Dropout)):
            module.register_forward_pre_hook(hook)


def _record_messages(client, pid: int, run: Run) -> None:
    def wrapped(kind, handler):
        def call(parameters, config):
            run.phase = kind
            received = [np.array(a, copy=True) for a in parameters]
            try:
                reply = handler(parameters, config)
            finally:
                run.phase = "between"
            run.messages.append(Message(pid, kind, dict(config), received, reply))
            return reply

        return call

    client.fit = wrapped("fit", client.fit)
    client.evaluate = wrapped("evaluate", client.evaluate)


@functools.cache
def federation(name: str, model: str) -> Run:
    """ROUNDS rounds of ``name`` on NUM_CLIENTS in-process clients with ``MODELS[model]``."""
    spec, case = ALGORITHMS[name], case_of(name)
    options = dataclasses.replace(spec.options(), **case.options)
    make_net, head = MODELS[model]
    run = Run(name, model)

    def client_fn(context: Context):
        torch.manual_seed(0)  # the same initial weights on every client, for both models
        net = make_net()
        _record_modes(net, run)
        pid = int(context.node_config["partition-id"])
        client = spec.client(context, net, local_data(pid), train_config(), head=head, **spec.client_kwargs(options))
        _record_messages(client, pid, run)
        run.clients[pid] = (net, client)
        return client.to_client()

    def server_fn(context: Context):
        strategy = spec.strategy(num_clients=NUM_CLIENTS, seed=0, num_rounds=ROUNDS,
                                 on_round=lambda *row: run.rows.append(row), **spec.strategy_kwargs(options))
        aggregate_fit = strategy.aggregate_fit

        def recorded(server_round, results, failures):
            parameters, metrics = aggregate_fit(server_round, results, failures)
            replies = [(int(res.metrics["partition_id"]), res.num_examples, parameters_to_ndarrays(res.parameters),
                        dict(res.metrics)) for _, res in results]
            out = None if parameters is None else parameters_to_ndarrays(parameters)
            run.aggregates.append((server_round, replies, out))
            return parameters, metrics

        strategy.aggregate_fit = recorded
        run.strategy = strategy
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))

    run.grid = run_inprocess(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), NUM_CLIENTS, {})
    return run


def wire_index(run: Run, suffix: str) -> list[int]:
    """Positions of the wire arrays whose user name ends with ``suffix`` (one per model copy)."""
    _, client = run.clients[0]
    return [i for i, key in enumerate(client.wire_names()) if key.endswith(suffix)]


ALL = sorted(ALGORITHMS)
BOTH = pytest.mark.parametrize("model", sorted(MODELS))


# ------------------------------------------------------------------------------ the tests
def test_every_registered_algorithm_has_a_case():
    missing, stale = sorted(set(ALGORITHMS) - set(CASES)), sorted(set(CASES) - set(ALGORITHMS))
    assert not missing, f"registered algorithms without a case in CASES: {missing}"
    assert not stale, f"cases of algorithms that are not registered: {stale}"


@BOTH
@pytest.mark.parametrize("name", ALL)
def test_the_run_completes_with_no_failed_client_and_finite_losses(name, model):
    run = federation(name, model)
    failed = [(r, phase, m.get("num_failures"), m.get("num_rejected")) for r, phase, m, _ in run.rows
              if m.get("num_failures", 0) or m.get("num_rejected", 0)]
    assert not failed, failed
    assert max(r for r, *_ in run.rows) == ROUNDS
    evaluated = [m for _, phase, m, _ in run.rows if phase == "evaluate"]
    assert len(evaluated) == ROUNDS and all(np.isfinite(m["loss_wmean"]) for m in evaluated)
    for message in run.messages:
        if message.kind == "evaluate":
            assert np.isfinite(message.reply[0]), message.pid
        elif "train_loss" in message.reply[2]:
            assert np.isfinite(message.reply[2]["train_loss"]), message.pid
    assert {m.pid for m in run.messages if m.kind == "fit"} == set(range(NUM_CLIENTS))


@BOTH
@pytest.mark.parametrize("name", ALL)
def test_evaluating_the_same_message_twice_under_different_random_states_gives_identical_results(name, model):
    """Dropout is off and BatchNorm uses its running statistics at evaluation: the last
    evaluate message of every client, handled again twice with torch's generator in two
    different states (and not reseeded by the client), gives the same loss and metrics as
    each other and as the message itself. An algorithm whose evaluation draws at random
    (Case.evaluation_draws) is handled twice under the same state."""
    run = federation(name, model)
    case = case_of(name)
    for pid in range(NUM_CLIENTS):
        _, client = run.clients[pid]
        last = [m for m in run.messages if m.pid == pid and m.kind == "evaluate"][-1]
        handler = type(client).evaluate.__wrapped__  # the handler without its per-message seeding
        answers = []
        for seed in (11, 11) if case.evaluation_draws else (11, 12):
            torch.manual_seed(seed)
            run.phase = "evaluate-again"
            answers.append(handler(client, [a.copy() for a in last.received], dict(last.config)))
        assert answers[0] == answers[1], pid
        if not case.evaluation_draws:
            assert answers[0][:2] == last.reply[:2], pid


@BOTH
@pytest.mark.parametrize("name", ALL)
def test_evaluation_forwards_without_gradients_run_in_eval_mode_and_training_runs_in_train_mode(name, model):
    """Every BatchNorm and Dropout forward inside ``evaluate`` that runs without gradients (a
    scoring pass, not a fine-tuning step) is in eval mode; ``fit`` trains with both in train mode."""
    run = federation(name, model)
    case_of(name)
    scoring = [(kind, training) for phase, kind, training, grad in run.modes if phase == "evaluate" and not grad]
    assert scoring, "no evaluation forward was recorded"
    assert not [s for s in scoring if s[1]], f"{len([s for s in scoring if s[1]])} of {len(scoring)} in train mode"
    training = {kind for phase, kind, train_mode, grad in run.modes if phase == "fit" and train_mode and grad}
    assert training == {"BatchNorm1d", "Dropout"}


@BOTH
@pytest.mark.parametrize("name", ALL)
def test_num_batches_tracked_stays_an_integer_on_every_array_that_crosses_the_wire(name, model):
    run = federation(name, model)
    case = case_of(name)
    positions = wire_index(run, "num_batches_tracked")
    if case.buffers in ("never-sent", "kept-local"):
        assert positions == []
        assert all(not m.received for m in run.messages) or case.buffers == "kept-local"
        net, _ = run.clients[0]
        assert net.state_dict()[[k for k in net.state_dict() if k.endswith("num_batches_tracked")][0]].dtype == torch.int64
        return
    assert positions
    seen = 0
    for message in run.messages:
        arrays = [message.received] + ([message.reply[0]] if message.kind == "fit" else [])
        for wire in arrays:
            if len(wire) > max(positions) and wire[positions[0]].shape == ():
                for i in positions:
                    assert np.issubdtype(wire[i].dtype, np.integer), (message.kind, message.config, wire[i].dtype)
                    seen += 1
    for server_round, replies, out in run.aggregates:
        if out is not None and case.buffers != "propagated":
            for i in positions:
                assert np.issubdtype(out[i].dtype, np.integer), (server_round, out[i].dtype)
                seen += 1
    assert seen
    for net, _ in run.clients.values():
        counters = [v for k, v in net.state_dict().items() if k.endswith("num_batches_tracked")]
        assert counters and all(c.dtype == torch.int64 for c in counters)


def _weighted(values, weights):
    w = np.asarray(weights, np.float64)
    return sum(wk * np.asarray(v, np.float64) for wk, v in zip(w / w.sum(), values))


@BOTH
@pytest.mark.parametrize("name", ALL)
def test_the_server_combines_the_batchnorm_running_statistics_as_the_algorithm_says(name, model):
    """running_mean, running_var and num_batches_tracked of the aggregate (or of what each
    client receives next) against the fit replies, by the algorithm's rule (Case.buffers).
    Local sends nothing: each client's step counter has counted every one of its own steps."""
    run = federation(name, model)
    case = case_of(name)
    if case.buffers in ("never-sent", "kept-local"):  # Local, FedBN: the statistics are the client's, kept
        for pid, (net, client) in run.clients.items():
            counter = [v for k, v in net.state_dict().items() if k.endswith("num_batches_tracked")][0]
            steps_per_round = -(-TRAIN_SIZES[pid] // 8) * client.train_config.local_epochs
            assert int(counter) == ROUNDS * steps_per_round, pid
        means = [[v for k, v in net.state_dict().items() if k.endswith("running_mean")][0] for net, _ in run.clients.values()]
        assert not torch.allclose(means[0], means[1]) and not torch.allclose(means[1], means[2])
        return
    checked = 0
    for suffix in ("running_mean", "running_var", "num_batches_tracked"):
        positions = wire_index(run, suffix)
        previous = None
        for server_round, replies, out in run.aggregates:
            fit_replies = [r for r in replies if len(r[2]) > max(positions)]
            if case.buffers == "propagated":
                checked += _check_propagated(run, server_round, positions, replies)
                continue
            if case.buffers == "own-latest":
                checked += _check_own_latest(run, server_round, positions, replies)
                continue
            assert out is not None
            for copy_index, i in enumerate(positions):
                if case.buffers == "mean" or (case.buffers == "mean-then-kept" and server_round <= case.options["t1_rounds"]):
                    expected = _weighted([r[2][i] for r in fit_replies], [r[1] for r in fit_replies])
                elif case.buffers == "mean-then-kept":
                    expected = previous[i]
                elif case.buffers == "sources-mean":
                    sources = [r for r in fit_replies if not r[3].get("is_target")]
                    assert len(sources) == NUM_CLIENTS - 1
                    expected = _weighted([r[2][i] for r in sources], [r[1] for r in sources])
                elif case.buffers == "target":
                    (target,) = [r for r in replies if r[3].get("is_target")]
                    expected = target[2][i]
                elif case.buffers == "per-domain-mean":
                    expected = _weighted([r[2][i] for r in fit_replies], [r[2][-1][copy_index] for r in fit_replies])
                elif case.buffers == "per-cluster-mean":  # a reply is one model: the statistics at positions[0]
                    members = [r for r in replies if r[3]["ifca_cluster"] == copy_index]
                    start = [m.received[i] for m in run.messages if m.kind == "fit" and m.config["server-round"] == server_round]
                    expected = (_weighted([r[2][positions[0]] for r in members], [r[1] for r in members]) if members
                                else start[0])
                else:  # pragma: no cover
                    raise AssertionError(f"unknown rule {case.buffers!r}")
                if np.issubdtype(out[i].dtype, np.integer):
                    np.testing.assert_array_equal(out[i], np.rint(expected).astype(out[i].dtype))
                else:
                    np.testing.assert_allclose(out[i], expected, rtol=1e-5, atol=1e-6)
                checked += 1
            previous = out
    assert checked


def _check_own_latest(run: Run, server_round: int, positions: list[int], replies) -> int:
    """Client k's next instruction (round ``server_round + 1``'s fit; after the last round, its
    evaluate instruction) carries k's own uploaded statistics and counter at ``positions``, bit for bit."""
    kind, wanted = ("evaluate", ROUNDS) if server_round == ROUNDS else ("fit", server_round + 1)
    received = {m.pid: m.received for m in run.messages if m.kind == kind and m.config.get("server-round") == wanted}
    uploads = {pid: arrays for pid, _, arrays, _ in replies}
    assert sorted(received) == sorted(uploads) == list(range(NUM_CLIENTS))
    for pid, arrays in received.items():
        for i in positions:
            assert arrays[i].dtype == uploads[pid][i].dtype and np.array_equal(arrays[i], uploads[pid][i]), (pid, i)
    return len(received) * len(positions)


def _check_propagated(run: Run, server_round: int, positions: list[int], replies) -> int:
    """Client k's auxiliary model after ``server_round`` (its next fit instruction; after the
    last round the server's final row) is sum_j P[k, j] theta_j at ``positions``."""
    received = {m.pid: m.received for m in run.messages
                if m.kind == "fit" and m.config.get("server-round") == server_round + 1 and len(m.received) > max(positions)}
    if server_round == ROUNDS:
        strategy = run.strategy
        received = {pid: strategy.layout.unflatten(strategy.theta_hat[pid]) for pid in range(NUM_CLIENTS)}
    assert sorted(received) == list(range(NUM_CLIENTS))
    propagation = np.asarray(run.strategy.graph.propagation, np.float64)
    uploads = {pid: arrays for pid, _, arrays, _ in replies}
    assert sorted(uploads) == list(range(NUM_CLIENTS))
    checked = 0
    for pid, arrays in received.items():
        for i in positions:
            expected = sum(propagation[pid, j] * np.asarray(uploads[j][i], np.float64) for j in uploads)
            got = arrays[i]
            if np.issubdtype(got.dtype, np.integer):
                np.testing.assert_array_equal(got, np.rint(expected).astype(got.dtype))
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            checked += 1
    return checked


def _numbers(rows) -> list:
    def clean(m):
        return {k: v for k, v in m.items() if "seconds" not in k}

    return [(r, phase, clean(m), {pid: clean(c) for pid, c in (clients or {}).items()}) for r, phase, m, clients in rows]


@pytest.mark.parametrize("name", ALL)
def test_a_head_registered_before_other_modules_gives_the_same_federation_as_a_head_registered_last(name):
    """MiddleHeadNet is BatchNormDropoutNet with its modules registered in another order (the
    head second of four, inside a ModuleDict): the head is found, and every round's metrics,
    every message's arrays and every client's final state are the same, number for number."""
    case_of(name)
    last, middle = federation(name, "bn-dropout"), federation(name, "head-in-middle")
    assert _numbers(middle.rows) == _numbers(last.rows)
    def in_client_order(run: Run) -> list[Message]:  # Flower's thread pool may interleave clients
        return sorted(run.messages, key=lambda m: m.pid)  # stable: each client's own order is kept

    assert len(middle.messages) == len(last.messages)
    for a, b in zip(in_client_order(last), in_client_order(middle)):
        assert (a.pid, a.kind, a.config) == (b.pid, b.kind, b.config)
        assert len(a.received) == len(b.received)
        for x, y in zip(a.received, b.received):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    for pid in range(NUM_CLIENTS):
        net_last, _ = last.clients[pid]
        net_middle, _ = middle.clients[pid]
        renamed = {"fc1": "layers.embed", "bn": "layers.norm", "fc2": "layers.head"}
        state = net_middle.state_dict()
        for key, value in net_last.state_dict().items():
            module, _, tensor = key.partition(".")
            assert torch.equal(state[f"{renamed[module]}.{tensor}"], value), (pid, key)


@pytest.mark.parametrize("name", ALL)
def test_the_head_not_registered_last_is_kept_personal_or_shared_as_the_algorithm_says(name):
    """With MiddleHeadNet: the head's tensors are on the wire only where the algorithm sends
    them; a personal head ends different on every client (none is a server's head); a shared
    head is the same on every client's last evaluate instruction."""
    case = case_of(name)
    run = federation(name, "head-in-middle")
    _, client = run.clients[0]
    on_wire = [k for k in client.wire_names() if k.endswith("layers.head.weight") or k.endswith("layers.head.bias")]
    assert bool(on_wire) == case.head_on_wire, client.wire_names()
    heads = [run.clients[pid][0].layers["head"].weight.detach().clone() for pid in range(NUM_CLIENTS)]
    if case.personal_head:
        for a in range(NUM_CLIENTS):
            for b in range(a + 1, NUM_CLIENTS):
                assert not torch.allclose(heads[a], heads[b]), (a, b)
        return
    positions = wire_index(run, "layers.head.weight")
    final = [m for m in run.messages if m.kind == "evaluate" and m.config.get("server-round") == ROUNDS]
    assert sorted(m.pid for m in final) == list(range(NUM_CLIENTS))
    for i in positions:
        for m in final[1:]:
            np.testing.assert_array_equal(m.received[i], final[0].received[i])
