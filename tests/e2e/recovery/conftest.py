"""Make the spawned ranks able to import the worker modules next to these tests."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # tests/e2e/recovery -> root
# Spawned ranks import workers by module name and ckptcache from the checkout; both must be on
# sys.path (the children inherit it) even when pytest runs in importlib mode.
for path in (_HERE, _ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
