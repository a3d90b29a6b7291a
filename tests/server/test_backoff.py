"""The one backoff policy: each retry site waits what its own formula used to give, jitter
stays below the bound, and a bad parameter is a typed error."""

from __future__ import annotations

import math
import random

import pytest

from ckptcache.errors import ConfigError
from ckptcache.server.backoff import ACCEPT, Backoff
from ckptcache.server.cluster import election
from ckptcache.server.restore import remote_load


def _old_accept(n: int) -> float:
    """The accept loops' inline formula, run ``n + 1`` times from 0."""
    backoff = 0.0
    for _ in range(n + 1):
        backoff = min(1.0, max(0.05, backoff * 2))
    return backoff


def _old_record_retry(n: int) -> float:
    """The persisted-record retry's: 0.2 s, doubled after each failure, at most 5 s."""
    delay = 0.2
    for _ in range(n):
        delay = min(delay * 2, 5.0)
    return delay


@pytest.mark.parametrize("attempt", range(12))
def test_each_site_waits_what_its_own_formula_gave(attempt):
    assert ACCEPT.delay(attempt) == pytest.approx(_old_accept(attempt))
    assert election.RECORD_RETRY.delay(attempt) == pytest.approx(_old_record_retry(attempt))
    # The remote load's bound (its draw is checked below) and the persist retries' formula.
    old_load = min(remote_load.BACKOFF_CAP, remote_load.BACKOFF_BASE * 2**attempt)
    assert remote_load.BACKOFF.bound(attempt) == pytest.approx(old_load)
    assert Backoff(0.5, 30.0).delay(attempt) == pytest.approx(min(0.5 * 2**attempt, 30.0))


def test_full_jitter_draws_below_the_bound_from_the_generator_given():
    policy = Backoff(0.004, 0.1, jitter=True)
    draws = [policy.delay(a, random.Random(a)) for a in range(20)]
    assert all(0.0 <= d <= policy.bound(a) for a, d in enumerate(draws))
    assert draws == [random.Random(a).uniform(0.0, policy.bound(a)) for a in range(20)]
    assert len(set(draws)) == len(draws)  # drawn, not the bound itself
    assert remote_load.BACKOFF.jitter


def test_the_bound_never_overflows_and_a_zero_first_wait_never_waits():
    assert Backoff(0.05, 1.0).delay(10**6) == 1.0
    assert Backoff(1e300, 1e308).delay(10**6) == 1e308
    assert Backoff(0.0, 30.0).delay(7) == 0.0  # persist_backoff = 0: retry at once
    assert Backoff(1.0, 4.0).delay(-3) == 1.0


@pytest.mark.parametrize(
    ("first", "cap"), [(-0.1, 1.0), (0.1, -1.0), (math.nan, 1.0), (0.1, math.inf), ("1", 2.0)]
)
def test_a_bad_parameter_is_a_config_error_that_names_it(first, cap):
    with pytest.raises(ConfigError, match=r"backoff (first|cap) must be a finite number"):
        Backoff(first, cap)
