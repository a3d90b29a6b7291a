"""pytest plugin: with ``CKPTCACHE_REQUIRE_ALL=1`` a skipped test fails, unless it needs a GPU
(or, marked ``privileged``, root and the right to mount).

The suite covers areas that need things installed (etcd, the moto S3 server, DeepSpeed,
megatron-core, Lightning). Without them those tests would skip and the run would still look
green; ``scripts/test.sh`` sets the variable so that CI cannot pass with an area missing. Tests
marked ``gpu`` may still skip on a machine without one, and tests marked ``privileged`` where
mounting is not allowed (their reason is printed by ``-ra``).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

ENV = "CKPTCACHE_REQUIRE_ALL"


def _required() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _as_failure(report: Any, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"{what} was skipped ({_reason(report)}), but {ENV} is set: install what it needs "
        "(scripts/setup.sh test) or mark it gpu if it needs a CUDA device"
    )


def _exempt(node: pytest.Item | pytest.Collector) -> bool:
    """Whether ``node`` needs something no install step can give (a GPU, mount rights)."""
    return any(node.get_closest_marker(name) is not None for name in ("gpu", "privileged"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    exempt = _exempt(item)
    # An expected failure (xfail) is reported as skipped too; it is not a missing area.
    if report.skipped and _required() and not exempt and not hasattr(report, "wasxfail"):
        _as_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _required() and not _exempt(collector):
        _as_failure(report, f"module {collector.nodeid}")
