"""Local training: every client trains its own model and never communicates."""

from __future__ import annotations

from flwr_pfl.clients.base import PFLClient


class LocalClient(PFLClient):
    """Local: the whole model is personal (kept in ``context.state``); the wire carries nothing.

    Fit replies carry zero arrays; the example count and metrics still travel so that the
    server can report training progress. Any ``torch.nn.Module`` works as it is.
    """

    shared_group = None
    personal_group = "all"
