#!/usr/bin/env bash
# The main job: install, start a daemon on the embedded single-node default (persisting under a
# scratch directory), save from a trainer that is then killed, see the file persisted, reload in
# a new process, print a benchmark table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ckptcache demo "$@"
