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
python -m pytest -p no:cacheprovider "$@"
