"""Flower's own DP strategy wrappers around a suite strategy: composed where they can be, refused
where they cannot, and never silently ineffective.

Flower's DP wrappers (legacy ``flwr.server.strategy.DifferentialPrivacy*`` and ``DPFedAvg*``; the
Message API's ``flwr.serverapp.strategy.DifferentialPrivacy*``) take the wrapped strategy's
replies to be the global arrays it sent, trained further, and its aggregate to be their mean:
they clip each reply's difference to the arrays sent and add noise to the aggregate the strategy
returns. That holds for the algorithms that accept the suite's own reply bounds (the FedAvg
family, FedRep/FedPer bodies; :attr:`PFLStrategy.robust_refusal
<flwr_pfl.strategies.base.PFLStrategy.robust_refusal>` is empty). For the others it fails in the
middle of a round (replies of other shapes) or, worse, runs on: a wrapper's noise on a reply
that carries statistics corrupts them while the run "completes". :func:`check_wrapped` refuses
them when the wrapper first asks the strategy for a round's instructions, before any client
trains, naming the algorithm and the reason.

Where a wrapper does apply, its noise is added to the aggregate *after* the strategy returned
it; the strategy then adopts the released arrays as its global arrays
(:meth:`~flwr_pfl.strategies.base.PFLStrategy.follow_released`), so that what it evaluates,
checkpoints and exports is the private model, not the noiseless one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from flwr.server import strategy as legacy
from flwr.serverapp import strategy as message_api

from flwr_pfl.errors import ConfigError

if TYPE_CHECKING:
    from flwr_pfl.strategies.base import PFLStrategy

#: Flower's DP wrappers, in both APIs
FLOWER_DP_WRAPPERS: tuple[type, ...] = (
    legacy.DifferentialPrivacyServerSideFixedClipping, legacy.DifferentialPrivacyClientSideFixedClipping,
    legacy.DifferentialPrivacyServerSideAdaptiveClipping, legacy.DifferentialPrivacyClientSideAdaptiveClipping,
    legacy.DPFedAvgFixed, legacy.DPFedAvgAdaptive,
    message_api.DifferentialPrivacyServerSideFixedClipping, message_api.DifferentialPrivacyClientSideFixedClipping,
    message_api.DifferentialPrivacyServerSideAdaptiveClipping, message_api.DifferentialPrivacyClientSideAdaptiveClipping,
)


#: frames looked at above the strategy's method for a wrapper calling it (the wrapper's method is
#: the caller, unless decorators or instrumentation sit between)
SEARCH_FRAMES = 12


def calling_wrapper(strategy: object) -> Any | None:
    """The Flower DP wrapper around ``strategy`` whose method is calling into it, or None: a
    frame on the call stack whose ``self`` is one of :data:`FLOWER_DP_WRAPPERS` with
    ``.strategy`` being ``strategy`` (a wrapper calls ``self.strategy.<method>``)."""
    frame = sys._getframe(1)
    for _ in range(SEARCH_FRAMES):
        frame = frame.f_back
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, FLOWER_DP_WRAPPERS) and getattr(caller, "strategy", None) is strategy:
            return caller
    return None


def check_wrapped(strategy: PFLStrategy, wrapper: Any) -> None:
    """ConfigError when ``wrapper`` (one of :data:`FLOWER_DP_WRAPPERS`) cannot wrap ``strategy``:
    an algorithm whose replies are not the global arrays trained further and averaged, or a
    strategy that already applies client-level DP or secure aggregation itself."""
    name, flower = type(strategy).__name__, type(wrapper).__name__
    refusal = strategy.robust_refusal or strategy._default_refusal()
    if refusal:
        raise ConfigError(f"{name} cannot run inside Flower's {flower}: {refusal}. Flower's DP wrappers clip each "
                          "reply against the arrays sent and noise the mean; use the suite's client-level DP "
                          "(dp-noise-multiplier) where the algorithm accepts it, or record-level DP")
    if strategy.private is not None:
        raise ConfigError(f"{name} already applies client-level DP (client_dp); inside Flower's {flower} it would be "
                          "clipped and noised twice, with two accountants that each ignore the other; use one")
    if strategy.secure_aggregation:
        raise ConfigError(f"{name} aggregates securely (secure_aggregation): Flower's {flower} clips each reply on "
                          "the server, which then sees none; use record-level DP with secure aggregation")
