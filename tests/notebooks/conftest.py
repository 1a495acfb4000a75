"""Run times of the teaching notebooks, collected by test_notebooks.py and printed after the run."""

from __future__ import annotations

import pytest

TIMINGS = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def notebook_timings(request) -> dict:
    """notebook name -> seconds, filled by each notebook test."""
    return request.config.stash.setdefault(TIMINGS, {})


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    timings = config.stash.get(TIMINGS, None)
    if not timings:
        return
    terminalreporter.section("teaching notebooks: run time")
    for name, seconds in sorted(timings.items()):
        terminalreporter.write_line(f"{seconds:6.1f} s  {name}")
    terminalreporter.write_line(f"{sum(timings.values()):6.1f} s  all {len(timings)} notebooks")
