"""What one message costs a deployed node: a fresh process from start to reply, and its peak memory.

A Flower SuperNode starts a new ``flwr-clientapp`` process for every message it is sent, so each
round a node pays the Python start-up, the ClientApp's imports, the client's build (its data and
model) and the training, again. This script measures exactly that path without a SuperLink: a
fresh Python process imports a ClientApp, builds the Message-API ``train`` message a strategy
sends (``{"arrays": ArrayRecord, "config": ConfigRecord}``), calls the app with the node's
Context and waits for the reply. The same message and the same node data (a ``.npz`` file of
Fashion-MNIST samples, the node's own file as in a deployment) go to:

* ``flower-quickstart``: a ClientApp written as Flower's quickstart-pytorch (Message API) writes
  one, training the same MLP for one epoch: the floor for a node that trains with torch on Flower;
* ``flwr_pfl <algorithm>``: the suite's own ClientApp (``flwr_pfl.app.client_app:app``), the one
  ``flwr run`` deploys, with the node config's ``data-path``;
* ``imports only``: ``import torch, flwr`` and nothing else.

Each contender runs ``--repeats`` times, alternating, in a fresh process each; the table gives
the fastest and the median wall time (process start to exit, the reply checked), the peak
resident memory (``wait4``'s ``ru_maxrss``) and, from inside the process, the seconds spent
importing and handling the message; and ratios to the quickstart in the same run.

    python simulations/node_message_cost.py --repeats 5 --out docs/benchmark
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import machine

REPO_ROOT = Path(__file__).resolve().parents[1]

#: the child's common part: build the train message from the saved arrays, call ``app``, check
#: the reply and print the timings
CALL = r"""
import json, sys, time
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict, Array
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1  # as flwr-clientapp sets them
arrays = np.load(sys.argv[1])
record = ArrayRecord({str(i): Array(arrays[f"a{i}"]) for i in range(len(arrays.files))})
content = RecordDict({"arrays": record, "config": ConfigRecord({"server-round": 1, "lr": 0.05})})
message = Message(content, dst_node_id=7, message_type="train")
context = Context(run_id=1, node_id=7, node_config=json.loads(sys.argv[2]), state=RecordDict(),
                  run_config=json.loads(sys.argv[3]))
t_imported = time.perf_counter()
reply = app(message, context)
assert not reply.has_error(), reply.error
assert len(reply.content["arrays"]) == len(record), "the reply lost arrays"
print(json.dumps({"import": t_imported - T0, "handle": time.perf_counter() - t_imported}))
"""

QUICKSTART = r"""
import time
T0 = time.perf_counter()
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()

def Net():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10))

@app.train()
def train(msg: Message, context: Context):
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in zip(model.state_dict(), msg.content["arrays"].to_numpy_ndarrays())})
    with np.load(context.node_config["data-path"]) as npz:
        x, y = torch.from_numpy(npz["x"]), torch.from_numpy(npz["y"])
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]), momentum=0.5)
    model.train()
    for images, labels in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(x)})})
    return Message(content=content, reply_to=msg)
"""

SUITE = r"""
import time
T0 = time.perf_counter()
from flwr_pfl.app.client_app import app
"""

IMPORTS = "import time\nT0 = time.perf_counter()\nimport torch, flwr\nprint('{\"import\": %f, \"handle\": 0.0}' % (time.perf_counter() - T0))\n"


def node_data(data_dir: Path, samples: int, work: Path) -> Path:
    """The node's own file: the first ``samples`` Fashion-MNIST training images, [0, 1], (N, 1, 28, 28)."""
    from torchvision.datasets import FashionMNIST

    dataset = FashionMNIST(str(data_dir), train=True, download=False)
    x = (dataset.data[:samples].numpy().astype(np.float32) / 255.0)[:, None]
    y = dataset.targets[:samples].numpy().astype(np.int64)
    path = work / "node.npz"
    np.savez(path, x=x, y=y)
    return path


def suite_run_config(algorithm: str) -> dict:
    """The app's default run config with ``algorithm``, the MLP, this node's data and one thread."""
    from flwr_pfl.app.appdir import default_run_config

    return {**default_run_config({"algorithm": algorithm, "model": "mlp", "num-clients": 2, "local-epochs": 1}),
            "output-dir": tempfile.mkdtemp(prefix="node-cost-")}


def wire_arrays(algorithm: str, data: Path, run_config: dict, work: Path) -> Path:
    """The arrays the algorithm's strategy sends a node, as the app's own client reports them."""
    from flwr_pfl.app.config import parse_experiment
    from flwr_pfl.data.node_files import NodeDataSpec, load_node_data
    from flwr_pfl.models import build_model
    from flwr_pfl.training import get_arrays

    experiment = parse_experiment(run_config)
    client_data = load_node_data(NodeDataSpec(path=str(data)), val_fraction=0.0, test_fraction=0.2, seed=0, who="node 0")
    model = build_model("mlp", client_data.input_shape, client_data.num_outputs)
    group = experiment.algorithm.client.shared_group or "all"
    path = work / f"arrays-{algorithm}.npz"
    np.savez(path, **{f"a{i}": a for i, a in enumerate(get_arrays(model, group))})
    return path


def quickstart_arrays(work: Path) -> Path:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10))
    path = work / "arrays-quickstart.npz"
    np.savez(path, **{f"a{i}": t.numpy() for i, t in enumerate(model.state_dict().values())})
    return path


def run_child(code: str, args: list[str]) -> dict:
    """Run ``code`` in a fresh process; wall time, peak RSS (MiB) and the child's own timings."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    if status != 0:
        raise RuntimeError(f"child failed ({status}):\n{err[-3000:]}")
    inner = json.loads(out.strip().splitlines()[-1])
    return {"wall": wall, "peak_mib": usage.ru_maxrss / 1024, **inner}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedrep"])
    parser.add_argument("--samples", type=int, default=600, help="the node's training samples")
    parser.add_argument("--data-dir", type=Path, default=Path("~/.cache/flwr_pfl/data").expanduser())
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmark")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="node-cost-"))
    data = node_data(args.data_dir, args.samples, work)
    node = json.dumps({"partition-id": 0, "num-partitions": 2, "data-path": str(data)})
    contenders: dict[str, tuple[str, list[str]]] = {
        "imports only (torch, flwr)": (IMPORTS, []),
        "flower-quickstart": (QUICKSTART + CALL, [str(quickstart_arrays(work)), node, "{}"]),
    }
    for algorithm in args.algorithms:
        run_config = suite_run_config(algorithm)
        contenders[f"flwr_pfl {algorithm}"] = (SUITE + CALL, [str(wire_arrays(algorithm, data, run_config, work)), node,
                                                             json.dumps(run_config)])
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    host = machine()
    load = [round(v, 2) for v in host["load_average_at_start"] or []]
    for _ in range(args.repeats):
        for name, (code, child_args) in contenders.items():  # alternating: load drifts hit every contender alike
            runs[name].append(run_child(code, child_args))
    floor = runs["flower-quickstart"]
    base_wall, base_mem = min(r["wall"] for r in floor), max(r["peak_mib"] for r in floor)
    rows = []
    for name, rs in runs.items():
        rows.append({"contender": name, "fastest_s": min(r["wall"] for r in rs),
                     "median_s": statistics.median(r["wall"] for r in rs), "peak_mib": max(r["peak_mib"] for r in rs),
                     "import_s": statistics.median(r["import"] for r in rs), "handle_s": statistics.median(r["handle"] for r in rs),
                     "time_vs_quickstart": min(r["wall"] for r in rs) / base_wall,
                     "memory_vs_quickstart": max(r["peak_mib"] for r in rs) / base_mem})
    command = "python simulations/node_message_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "load_average_at_start": load, "host": host,
              "repeats": args.repeats, "samples": args.samples, "rows": rows, "runs": runs, "command": command.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "node_message_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# A deployed node's cost per message", "",
             f"One Message-API `train` message handled in a fresh process (what `flwr-clientapp` is for every message), "
             f"from process start to the checked reply; the node trains one epoch of the MLP on its own {args.samples} "
             f"Fashion-MNIST samples (a `.npz` file). {args.repeats} repeats, alternating; fastest and median wall time, "
             f"peak resident memory, and the median seconds inside the process spent importing and handling. "
             f"{report['date']}, {report['machine']}, {report['cpus']} CPUs, load average {load} at the start. "
             f"Command: `{report['command']}`.", "",
             "| contender | fastest (s) | median (s) | peak memory (MiB) | import (s) | handle (s) | time vs quickstart | memory vs quickstart |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['contender']} | {r['fastest_s']:.2f} | {r['median_s']:.2f} | {r['peak_mib']:.0f} | "
                     f"{r['import_s']:.2f} | {r['handle_s']:.2f} | {r['time_vs_quickstart']:.2f}x | {r['memory_vs_quickstart']:.2f}x |")
    (args.out / "node_message_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
