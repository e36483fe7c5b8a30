"""flwr_pfl's algorithms as Flower Message-API strategies (``flwr.serverapp.strategy.Strategy``).

Every flwr_pfl strategy has a Message-API class here with the same name and the same
constructor arguments (Flower's Message-API names ``fraction_train``, ``min_train_nodes``,
``min_evaluate_nodes``, ``min_available_nodes`` are taken too); ``__all__`` lists them.
Use them as any Flower strategy, with clients registered by :func:`flwr_pfl.clientapp.register_handlers`::

    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr_pfl.serverapp import FedRep

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedRep(num_clients=10, fraction_train=0.5, num_rounds=20)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=20)

Design: one copy of each algorithm. The round logic (which nodes a round samples, what each
is sent, the side exchanges inside a round such as FedDAR's head phase and domain counts,
FEDORA's setup and the partition-id queries, the checks that reject NaN/Inf, wrong shapes
and wrong counts, the aggregation, metrics, checkpoint state) lives in the legacy strategy
(:mod:`flwr_pfl.strategies`), which both flavours run. This package only translates:

* :class:`~flwr_pfl.serverapp.nodes.MessageNode` is the logic's ``ClientProxy`` for a node of
  the ``Grid``: each ``fit`` / ``evaluate`` / ``get_properties`` call is one native ``train`` /
  ``evaluate`` / ``query`` Message (records by :mod:`flwr_pfl.messages`), and a failed reply
  raises, so that the logic counts a failure; :class:`~flwr_pfl.serverapp.nodes.GridClientManager`
  offers the grid's current nodes to the logic's sampling;
* :class:`~flwr_pfl.serverapp.strategy.PFLMessageStrategy` maps Flower's
  ``configure_train`` / ``aggregate_train`` / ``configure_evaluate`` / ``aggregate_evaluate``
  onto the logic's ``configure_fit`` / ``aggregate_fit`` / ... (each instruction a Message, each
  reply a FitRes / EvaluateRes or a failure) and keeps Flower's ``start()``;
* :mod:`~flwr_pfl.serverapp.layout` takes the wire arrays out of a whole ``state_dict`` by name;
* :mod:`~flwr_pfl.serverapp.algorithms` generates the per-algorithm classes from the legacy ones.

The same configuration and seed give the same numbers in both flavours (global arrays,
every client's state, every round's metrics); the app runs either (run-config key ``api``).
"""

from flwr_pfl.serverapp.algorithms import MESSAGE_STRATEGIES, message_flavour
from flwr_pfl.serverapp.nodes import GridClientManager, MessageNode, NodeFailure
from flwr_pfl.serverapp.strategy import PFLMessageStrategy

# one name per class, spelled out for readers and type checkers (the test suite checks that
# these are exactly MESSAGE_STRATEGIES)
APFL = MESSAGE_STRATEGIES["APFL"]
Ditto = MESSAGE_STRATEGIES["Ditto"]
FedAMP = MESSAGE_STRATEGIES["FedAMP"]
FEDORA = MESSAGE_STRATEGIES["FEDORA"]
FedAvg = MESSAGE_STRATEGIES["FedAvg"]
FedAvgMultiHead = MESSAGE_STRATEGIES["FedAvgMultiHead"]
FedBABU = MESSAGE_STRATEGIES["FedBABU"]
FedBN = MESSAGE_STRATEGIES["FedBN"]
FedDA = MESSAGE_STRATEGIES["FedDA"]
FedDAR = MESSAGE_STRATEGIES["FedDAR"]
FedFMTL = MESSAGE_STRATEGIES["FedFMTL"]
FedFomo = MESSAGE_STRATEGIES["FedFomo"]
FedGP = MESSAGE_STRATEGIES["FedGP"]
FedPAC = MESSAGE_STRATEGIES["FedPAC"]
FedPer = MESSAGE_STRATEGIES["FedPer"]
FedProx = MESSAGE_STRATEGIES["FedProx"]
FedProxFinetune = MESSAGE_STRATEGIES["FedProxFinetune"]
FedRep = MESSAGE_STRATEGIES["FedRep"]
FedRoD = MESSAGE_STRATEGIES["FedRoD"]
Finetune = MESSAGE_STRATEGIES["Finetune"]
IFCA = MESSAGE_STRATEGIES["IFCA"]
KNNPer = MESSAGE_STRATEGIES["KNNPer"]
LGFedAvg = MESSAGE_STRATEGIES["LGFedAvg"]
Local = MESSAGE_STRATEGIES["Local"]
PFedFDA = MESSAGE_STRATEGIES["PFedFDA"]
PFedMe = MESSAGE_STRATEGIES["PFedMe"]
PerFedAvg = MESSAGE_STRATEGIES["PerFedAvg"]
PFedHN = MESSAGE_STRATEGIES["PFedHN"]
ReweightedFedAvg = MESSAGE_STRATEGIES["ReweightedFedAvg"]
SeparateFedAvg = MESSAGE_STRATEGIES["SeparateFedAvg"]
SourceOnly = MESSAGE_STRATEGIES["SourceOnly"]
TargetOnly = MESSAGE_STRATEGIES["TargetOnly"]

__all__ = [
    "GridClientManager", "MESSAGE_STRATEGIES", "MessageNode", "NodeFailure", "PFLMessageStrategy",
    "message_flavour", *sorted(MESSAGE_STRATEGIES),
]
