"""Hides the data plane's record extension from every process started with this folder on
``PYTHONPATH`` (the benchmark and the daemons it starts), so that one run of ``cpu.py``
measures the Python tags and digests (two passes) that a node without the extension runs:

    PYTHONPATH=benchmarks/replication/python_tags python benchmarks/replication/cpu.py ...
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

HIDDEN = "ckptcache.server.cluster.dataplane._records"


class _Hide(MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == HIDDEN:
            raise ImportError(f"{HIDDEN} hidden by {__file__}")
        return None


sys.meta_path.insert(0, _Hide())
