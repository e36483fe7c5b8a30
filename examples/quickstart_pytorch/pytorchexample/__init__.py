"""Flower's quickstart-pytorch app, switched to flwr_pfl's personalized algorithms."""
