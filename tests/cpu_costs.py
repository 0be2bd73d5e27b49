"""What each test costs, in CPU seconds rather than wall-clock ones: on a machine shared with
other jobs the wall clock says more about the neighbours than about the test.

``FPIPE_TEST_COSTS=costs.txt python -m pytest ...`` (tests/conftest.py loads these hooks when
the variable is set) writes a table sorted by CPU: per test the CPU seconds of the test process
and of its children (ranks, ``torchrun``, scripts: ``getrusage`` of ``SELF`` and ``CHILDREN``
for those it waited for, /proc for those still running, a fork server) over setup, call and
teardown, and the wall seconds. Under pytest-xdist each worker measures its tests and the
controller writes the table. On an idle machine a test run alone takes about max(CPU, what it
waits for) of wall time; the suite under ``-n 2`` about its total CPU over 2 where the waits
overlap.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

COSTS_ENV = "FPIPE_TEST_COSTS"
_rows: list[tuple[float, float, str, str]] = []


def _cpu() -> float:
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
            + _descendants_cpu())


def _descendants_cpu() -> float:
    """The CPU seconds so far of the descendants still running (a fork server and the ranks
    it forked and reaped; getrusage counts only children this process waited for)."""
    parent, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            parent[int(entry)] = int(fields[1])
            ticks[int(entry)] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    mine, total = {os.getpid()}, 0
    changed = True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                total += ticks[pid]
                changed = True
    return total / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    item._cost_start = (_cpu(), time.monotonic())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and hasattr(item, "_cost_start"):
        cpu, wall = item._cost_start
        item.user_properties.append(("cost", (_cpu() - cpu, time.monotonic() - wall)))
    yield


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    for name, value in report.user_properties:
        if name == "cost":
            worker = getattr(report, "node", None)
            worker = getattr(worker, "gateway", None)
            _rows.append((*value, report.nodeid, getattr(worker, "id", "-")))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or not _rows:
        return  # an xdist worker: the controller writes the table
    rows = sorted(_rows, reverse=True)
    cpu, wall = sum(r[0] for r in rows), sum(r[1] for r in rows)
    lines = [f"# {len(rows)} tests: {cpu:.1f} CPU s, {wall:.1f} wall s summed over tests",
             f"{'CPU s':>8} {'wall s':>8}  worker  test"]
    lines += [f"{c:8.2f} {w:8.2f}  {k:6}  {n}" for c, w, n, k in rows]
    with open(os.environ[COSTS_ENV], "w") as out:
        out.write("\n".join(lines) + "\n")
