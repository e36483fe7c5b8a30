"""The ClientApp's per-process cache: reused config, data and models give the numbers of a fresh
build, and nothing of one run reaches another."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from flwr_pfl.app import client_cache
from flwr_pfl.app.client_app import CACHE, build_client
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.models import build_model
from flwr_pfl.training import OptimizerConfig, train

NUM_CLIENTS = 5


@pytest.fixture(scope="module")
def domain_dataset() -> str:
    """'test-cache-domains': 3 classes x 2 domains in 10 dimensions, 900 samples."""
    from flwr_pfl.data.registry import DatasetPool, register_dataset

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(5)
        centers, offsets = 2.0 * torch.randn(3, 10, generator=g), torch.randn(2, 10, generator=g)
        y = torch.arange(900) % 3
        d = (torch.arange(900) // 3) % 2
        return DatasetPool(x=centers[y] + offsets[d] + torch.randn(900, 10, generator=g), y=y, domain=d,
                           num_classes=3, num_domains=2)

    register_dataset("test-cache-domains", build, replace=True)
    return "test-cache-domains"


def config(tmp_path, dataset: str, algorithm: str, name: str, **overrides) -> dict:
    """Unequal clients (Dirichlet labels), partial participation, momentum: state that matters."""
    cfg = {
        "algorithm": algorithm, "dataset": dataset, "model": "mlp", "num-clients": NUM_CLIENTS,
        "num-server-rounds": 3, "fraction-fit": 0.6, "fraction-evaluate": 0.6, "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5, "learning-rate": 0.05, "momentum": 0.9, "batch-size": 16, "seed": 4,
        "output-dir": str(tmp_path), "run-name": name,
    }
    if algorithm.startswith("feddar"):
        cfg |= {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 90, "feddar.head-epochs": 1}
    return cfg | overrides


def fresh_client_fn(context: Context):
    """Everything built anew for every message, as before the cache existed."""
    CACHE.clear()
    return build_client(context).to_client()


#: no lifespan: build_client runs outside a message scope and gets a model of its own
fresh_app = ClientApp(client_fn=fresh_client_fn)


def metrics(tmp_path, cfg: dict, app: ClientApp) -> bytes:
    run_inprocess(server_app, app, cfg["num-clients"], cfg)
    out = tmp_path / cfg["run-name"]
    return (out / "metrics.json").read_bytes() + (out / "clients.json").read_bytes()


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep", "finetune", "pfedfda", "fedora", "feddar-sa"])
def test_cached_clients_give_the_numbers_of_fresh_ones(tmp_path, domain_dataset, algorithm):
    """The same run with the cache and with every client built from scratch: identical bytes.
    (A reused model that kept its trained weights, gradients, frozen flags or eval mode, or a
    client that saw another node's data, would change the numbers.)"""
    CACHE.clear()
    cached = metrics(tmp_path, config(tmp_path, domain_dataset, algorithm, "cached"), client_app)
    fresh = metrics(tmp_path, config(tmp_path, domain_dataset, algorithm, "fresh"), fresh_app)
    assert cached == fresh


def test_two_runs_in_one_process_share_nothing(tmp_path, domain_dataset):
    """Runs with the same run id (as the in-process engine numbers them) but other settings, one
    after the other, each give what they give in a clean process."""
    first = config(tmp_path, domain_dataset, "fedrep", "first")
    second = config(tmp_path, domain_dataset, "fedrep", "second", seed=9, **{"dirichlet-alpha": 2.0})
    CACHE.clear()
    metrics(tmp_path, first, client_app)
    after_first = metrics(tmp_path, second, client_app)
    CACHE.clear()
    clean = metrics(tmp_path, second | {"run-name": "clean"}, client_app)
    assert after_first == clean
    assert after_first != metrics(tmp_path, first | {"run-name": "again"}, client_app)


def test_a_new_run_id_or_config_starts_a_new_cache(domain_dataset):
    cfg = {"dataset": domain_dataset, "model": "mlp", "num-clients": NUM_CLIENTS}
    CACHE.clear()
    run = CACHE.run(1, cfg)
    assert CACHE.run(1, dict(cfg)) is run
    assert CACHE.run(2, cfg) is not run
    other = CACHE.run(2, cfg | {"seed": 1})
    assert other.experiment.run.seed == 1 and CACHE.run(2, cfg) is not other


def node(run_config: dict, partition: int) -> Context:
    return Context(run_id=1, node_id=100 + partition, node_config={"partition-id": partition, "num-partitions": NUM_CLIENTS},
                   state=RecordDict(), run_config=run_config)


def test_models_are_leased_per_message_and_reused_after(tmp_path, domain_dataset):
    cfg = config(tmp_path, domain_dataset, "fedavg", "x")
    CACHE.clear()
    with CACHE.message():
        a = build_client(node(cfg, 0)).model
        b = build_client(node(cfg, 1)).model  # two clients in one scope never share a model
    assert a is not b
    with CACHE.message():
        c = build_client(node(cfg, 2)).model
    assert c is a or c is b  # given back when the scope ended, then reused
    assert build_client(node(cfg, 2)).model not in (a, b)  # outside a message: a model of its own
    # each partition gets its own data, loaded once
    inputs = [build_client(node(cfg, p)).data.train.dataset.tensors[0] for p in (3, 3, 4)]
    assert inputs[0] is inputs[1] and inputs[0] is not inputs[2]


def test_reset_restores_a_used_model_exactly():
    torch.manual_seed(0)
    template = build_model("mlp", (6,), 3, num_heads=2)
    model = __import__("copy").deepcopy(template)
    x, y, d = torch.randn(20, 6), torch.randint(0, 3, (20,)), torch.randint(0, 2, (20,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, d), batch_size=5)
    train(model, loader, optimizer=OptimizerConfig(learning_rate=0.5, momentum=0.9), device=torch.device("cpu"))
    model.heads[1].weight.requires_grad_(False)
    model.encoder.eval()
    assert any(p.grad is not None for p in model.parameters())
    client_cache.reset_model(model, template)
    for (name, p), q in zip(model.named_parameters(), template.parameters()):
        assert torch.equal(p, q) and p.grad is None and p.requires_grad == q.requires_grad, name
    assert all(m.training == t.training for m, t in zip(model.modules(), template.modules()))


def test_a_model_whose_tensors_or_layers_changed_is_not_reused():
    pool = client_cache.ModelPool(lambda: build_model("mlp", (6,), 3))
    model = pool.take()
    pool.give_back(model)
    assert pool.take() is model  # intact: reused
    model.double()
    pool.give_back(model)
    assert pool.take() is not model
    other = pool.take()
    other.heads[0] = torch.nn.Linear(other.feature_dim, 3)
    pool.give_back(other)
    assert pool.take() is not other


def test_client_data_beyond_the_budget_is_dropped_least_recent_first(tmp_path, domain_dataset, monkeypatch):
    cfg = config(tmp_path, domain_dataset, "fedavg", "x")
    CACHE.clear()
    run = CACHE.run(1, cfg)
    build_client(node(cfg, 0))
    build_client(node(cfg, 1))
    assert list(run._data) == [(0, NUM_CLIENTS, None), (1, NUM_CLIENTS, None)]  # the run's dataset: no other source
    monkeypatch.setattr(client_cache, "DATA_BUDGET_BYTES", 1)  # keeps the newest partition only
    build_client(node(cfg, 2))
    assert list(run._data) == [(2, NUM_CLIENTS, None)]


# ------------------------------------------------------------------------------ unit contracts
def _client_data(n: int) -> "client_cache.ClientData":
    """A partition of ``n`` training samples of 4 float32 features: 16 n + 8 n + 8 n = 32 n bytes."""
    from flwr_pfl.data.types import ArraySplit, ClientData

    split = ArraySplit(torch.zeros(n, 4), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    empty = ArraySplit(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    return ClientData(train=split, val=empty, test=empty, num_classes=2, num_domains=1, input_shape=(4,))


def _loads(run: client_cache.RunCache, pids: list[int], counter: dict[int, int]) -> None:
    for pid in pids:
        def load(pid: int = pid) -> client_cache.ClientData:
            counter[pid] = counter.get(pid, 0) + 1
            return _client_data(10)  # 320 bytes each
        run.client_data(pid, 4, load)


def test_the_data_budget_counts_every_partitions_bytes_and_evicts_only_what_exceeds_it(monkeypatch):
    """Budget 800 bytes, partitions of 320: two fit (640), a third (960) evicts the oldest; after
    the eviction the count is 640 again, so a fourth load evicts exactly one more; a total equal to
    the budget is kept."""
    from flwr_pfl.app.appdir import default_run_config

    run = client_cache.RunCache(1, default_run_config({}))
    monkeypatch.setattr(client_cache, "DATA_BUDGET_BYTES", 800)
    loads: dict[int, int] = {}
    _loads(run, [0, 1], loads)
    assert [k[0] for k in run._data] == [0, 1] and run._data_bytes == 640
    _loads(run, [2], loads)
    assert [k[0] for k in run._data] == [1, 2] and run._data_bytes == 640
    _loads(run, [0], loads)  # reloaded; 1 goes, 2 stays
    assert [k[0] for k in run._data] == [2, 0] and run._data_bytes == 640
    _loads(run, [2], loads)  # still cached: not loaded again, and now the most recent
    assert loads == {0: 2, 1: 1, 2: 1} and [k[0] for k in run._data] == [0, 2]
    monkeypatch.setattr(client_cache, "DATA_BUDGET_BYTES", 960)
    _loads(run, [3], loads)  # 960 == the budget: nothing is dropped
    assert [k[0] for k in run._data] == [0, 2, 3] and run._data_bytes == 960


def test_a_new_run_cache_counts_no_bytes():
    from flwr_pfl.app.appdir import default_run_config

    assert client_cache.RunCache(1, default_run_config({}))._data_bytes == 0


def test_inside_a_message_each_architecture_has_its_own_pool_and_models_go_back_at_its_end():
    from flwr_pfl.app.appdir import default_run_config

    cache = client_cache.ClientCache()
    run = cache.run(1, default_run_config({}))
    with cache.message():
        mlp = cache.model(run, "mlp", lambda: build_model("mlp", (6,), 3))
        other = cache.model(run, "mlp-wide", lambda: build_model("mlp", (9,), 3))
        assert mlp is not other and mlp.heads[0].out_features == 3
        assert next(other.parameters()).shape != next(mlp.parameters()).shape  # each key its own build
    with cache.message():  # given back at the end of the last message: leased again
        assert cache.model(run, "mlp", lambda: build_model("mlp", (6,), 3)) is mlp
        assert cache.model(run, "mlp-wide", lambda: build_model("mlp", (9,), 3)) is other
    fresh = cache.model(run, "mlp", lambda: build_model("mlp", (6,), 3))  # outside a message: a new build
    assert fresh is not mlp


def test_giving_back_a_model_the_pool_never_leased_is_a_no_op():
    pool = client_cache.ModelPool(lambda: build_model("mlp", (6,), 3))
    stranger = build_model("mlp", (6,), 3)
    pool.give_back(stranger)  # neither raises nor adds it to the pool
    model = pool.take()
    assert model is not stranger
    pool.give_back(model)
    pool.give_back(model)  # twice: the second is a no-op too
    assert pool.take() is model and pool.take() is not model


def test_reset_restores_batchnorm_running_statistics_and_counters():
    template = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    pool = client_cache.ModelPool(lambda: template)
    model = pool.take()
    model.train()
    model(torch.randn(8, 4) * 5 + 3)  # moves the running statistics and the batch counter
    assert not torch.equal(model[1].running_mean, template[1].running_mean)
    pool.give_back(model)
    again = pool.take()
    assert again is model
    for name, buffer in again.named_buffers():
        assert torch.equal(buffer, dict(template.named_buffers())[name]), name
