#!/usr/bin/env bash
# The test job: install everything the tests need, then lint, type-check and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check ckptcache tests benchmarks
ruff format --check ckptcache tests benchmarks
mypy
# The docs site: --strict makes a broken link or anchor fail the build (never pass -q: it
# hides the warnings that strict mode counts).
mkdocs build --strict
# A skipped test fails the run (tests/_require_all.py): every area must really run here, only
# tests marked gpu may skip (their reasons are listed by -ra).
# Two workers, each taking whole files (a file's daemons, lab and etcd stay in one process):
# most tests wait on daemons, etcd and links, so two cores finish in about half the time. The
# slowest tests are listed at the end: the suite is kept well under 20 minutes.
CKPTCACHE_REQUIRE_ALL=1 python -m pytest -p no:cacheprovider -n 2 --dist loadfile \
    --durations=25 "$@"
