"""Flower's Message-API quickstart-pytorch switched to flwr_pfl algorithms."""
