#!/usr/bin/env bash
# Install the open peers of ckptcache into this benchmark's own environment
# (benchmarks/peers/.venv, git-ignored). None of them becomes a dependency of the project.
#
#   bash benchmarks/peers/setup.sh [PROJECT_PYTHON]
#
# PROJECT_PYTHON (default: .venv/bin/python at the repository root, else python3) is the
# interpreter that has torch and ckptcache's own dependencies; the new environment sees its
# site-packages through a .pth file, so torch is the same build the project tests with. Every
# pip call is constrained to that torch version: a peer that asks for another (CUDA) build
# fails to install instead of replacing it. A peer that fails to install is reported and
# skipped; bench.py lists it with its error.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
project_python="${1:-}"
if [ -z "$project_python" ]; then
    if [ -x "$root/.venv/bin/python" ]; then project_python="$root/.venv/bin/python"
    else project_python="$(command -v python3)"; fi
fi
venv="${PEERS_VENV:-$here/.venv}"  # PEERS_VENV: another place, e.g. to test this script
"$project_python" -m venv "$venv" || exit 1
py="$venv/bin/python"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$project_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$site/_project_site.pth"
torch_version="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')" || {
    echo "torch is not importable from $project_python" >&2; exit 1; }
constraints="$venv/constraints.txt"
echo "torch==$torch_version" > "$constraints"
pip=("$py" -m pip install --quiet -c "$constraints")
status=0
install() {  # install NAME ARGS...: one peer; a failure is reported, not fatal
    local name="$1"; shift
    if "${pip[@]}" "$@" > "$venv/install-$name.log" 2>&1; then echo "installed $name"
    else echo "FAILED $name (see $venv/install-$name.log)"; status=1; fi
}
# DLRover's flash checkpoint: its declared deps (pynvml, requests...) are light; it also
# imports grpc, which only its k8s extra declares.
install dlrover "dlrover[torch]==0.6.1" grpcio  # dlrover imports grpc unconditionally
# lm-resiliency (open Gemini): numpy and torch<2.14, both already satisfied.
install lm-resiliency "lm-resiliency==0.2.0"
# NVIDIA Resiliency Extension: 0.7.0 ships only cp312 wheels (its one compiled module is a
# CUPTI profiler the checkpointing code does not import); PyPI offers this Python at most
# 0.4.1. The 0.7.0 wheel is unpacked into its own directory, without its service deps
# (fastapi, grpc, slack...), which the checkpointing modules do not import.
mkdir -p "$venv/nvrx"
install nvidia-resiliency-ext --no-deps --target "$venv/nvrx" --upgrade \
    --python-version 3.12 --platform manylinux_2_39_x86_64 --only-binary=:all: \
    "nvidia-resiliency-ext==0.7.0"
echo "$venv/nvrx" > "$site/_nvrx.pth"
install ml-flashpoint "ml-flashpoint==0.0.10"
exit $status
