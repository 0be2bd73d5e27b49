"""Shared test settings: hypothesis profiles, chosen by the HYPOTHESIS_PROFILE variable; with
FPIPE_TEST_COSTS set, a table of what each test costs (tests/cpu_costs.py)."""

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if os.environ.get("FPIPE_TEST_COSTS"):
    from cpu_costs import (  # noqa: F401
        pytest_runtest_logreport,
        pytest_runtest_makereport,
        pytest_runtest_protocol,
        pytest_sessionfinish,
    )
