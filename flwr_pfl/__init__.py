"""flwr_pfl: personalized and domain-aware federated learning algorithms for Flower.

Each algorithm is a Flower Strategy (``flwr_pfl.strategies``) plus a Flower NumPyClient
(``flwr_pfl.clients``) over shared torch training utilities (``flwr_pfl.training``); its
mathematics lives, free of Flower, in ``flwr_pfl.core``.
"""

__version__ = "0.1.0"
