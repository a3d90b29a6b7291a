"""How long the daemon waits before trying again: one policy for every retry loop.

Exponential with a cap, optionally with full jitter (a uniform draw below the exponential
bound, so waiters that failed together do not retry together). Each site keeps its own
parameters, named where it retries:

==========================================  =======  =====  ======
site                                        first    cap    jitter
==========================================  =======  =====  ======
remote load waiting for a storage reader    0.004 s  0.1 s  full
recording a persist past an etcd outage     0.2 s    5 s    none
data-plane and control accept, out of fds   0.05 s   1 s    none
persist retries (``persist_backoff``)       0.5 s    30 s   none
==========================================  =======  =====  ======

The trainer side's polling waits (``data/loader.py``) keep their own: the trainer side never
imports the daemon.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ckptcache.errors import ConfigError

__all__ = ["ACCEPT", "Backoff"]

#: Attempts past which the bound no longer grows: 2**64 times any first wait is past every
#: cap, and a larger power would overflow a float.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True)
class Backoff:
    """Wait ``first * 2**attempt`` seconds before attempt ``attempt + 1``, at most ``cap``;
    with ``jitter``, a uniform draw in ``[0, that bound]`` instead."""

    first: float
    cap: float
    jitter: bool = False

    def __post_init__(self) -> None:
        for name in ("first", "cap"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"backoff {name} must be a finite number >= 0, not {value!r}")

    def bound(self, attempt: int) -> float:
        """The longest wait after ``attempt`` failed tries (0: after the first)."""
        return min(self.cap, self.first * 2.0 ** min(max(attempt, 0), _MAX_DOUBLINGS))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after ``attempt`` failed tries: :meth:`bound`, or a draw below it with
        ``jitter`` (from ``rng``, else the module's generator)."""
        bound = self.bound(attempt)
        if not self.jitter:
            return bound
        return (rng or random).uniform(0.0, bound)


#: An accept loop out of descriptors (or kernel memory): its pending connection stays in the
#: backlog while handshakes end or time out.
ACCEPT = Backoff(0.05, 1.0)
