"""Wiring for ``flwr run``: config parsing, the algorithm registry, the ServerApp/ClientApp, results."""
