"""One module per algorithm (or family) that registers it; see flwr_pfl.app.registry."""
