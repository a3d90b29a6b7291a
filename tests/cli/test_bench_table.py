"""Benchmark tables never show a ratio to a copy's limit for what copies nothing."""

from __future__ import annotations

from ckptcache.cli.benchmarking import Row, format_table


def test_rows_that_copy_nothing_get_no_ratio_to_memcpy():
    limit = Row("memcpy (physical limit)", 1 << 20, 0.010)
    rows = [limit, Row("save", 1 << 20, 0.020), Row("zero-copy load", 1 << 20, 0.001, copies=False)]
    lines = format_table(rows, limit=limit).splitlines()
    assert lines[3].endswith("| 0.50x |")  # the save: half the speed of the copy
    assert lines[4].endswith("| - (no copy) |") and "10.00x" not in lines[4]
