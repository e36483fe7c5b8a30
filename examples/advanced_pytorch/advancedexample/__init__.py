"""Flower's advanced-pytorch example switched to flwr_pfl algorithms."""
