"""Hypothesis settings of the property tests: one derandomized profile, so that every run (and
CI) draws the same cases and a property either holds on them or fails the same way every time.

Each test sets its own ``max_examples`` (cheap cases many, costly ones few) and ``deadline=None``
(a shared CI machine's timing must not fail a property); the profile fixes everything else.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "flwr_pfl-properties",
    derandomize=True,
    deadline=None,
    print_blob=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("flwr_pfl-properties")
