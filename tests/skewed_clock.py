"""Run ``-m MODULE ARGS`` with this process's wall clock (``time.time``, ``time.time_ns``)
shifted by ``$CKPTCACHE_TEST_CLOCK_SKEW`` seconds: a node whose clock runs ahead. The
monotonic clock and sleeps are left alone (libfaketime's ``clock_nanosleep`` makes
``time.sleep`` fail in some images, and with it the daemon's election)."""

from __future__ import annotations

import os
import runpy
import sys
import time

_skew = float(os.environ.get("CKPTCACHE_TEST_CLOCK_SKEW", "0"))
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _skew
time.time_ns = lambda: _time_ns() + round(_skew * 1e9)

if __name__ == "__main__":
    if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
        raise SystemExit("usage: skewed_clock.py -m MODULE [ARGS...]")
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
