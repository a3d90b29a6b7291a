"""The ``ckptcache`` command (:mod:`ckptcache.cli.commands`), with what only it and the
benchmarks use: its output (:mod:`~ckptcache.cli.output`), the ``bench`` and ``demo``
commands, and the measuring helpers they share with ``benchmarks/``
(:mod:`~ckptcache.cli.benchmarking`).

``python -m ckptcache.cli`` runs the command, as the ``ckptcache`` script does.
"""

from ckptcache.cli.commands import main

__all__ = ["main"]
